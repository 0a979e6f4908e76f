#!/usr/bin/env bash
# The gate step of action.yml. Inputs come as environment variables (never pasted into a script):
#   DDTREE_DIAG_URL, DDTREE_DIAG_API_KEY (read by ddtree-diag itself), INPUT_MATRIX,
#   INPUT_BASELINE, INPUT_AGAINST, INPUT_TARGETS (a fleet's targets file), INPUT_ARGS (extra flags,
#   split like a shell by Python's shlex), INPUT_OUTPUT_DIR.
# Writes junit.xml, report.html, report.json and summary.md into the output folder; the gate
# appends the summary to $GITHUB_STEP_SUMMARY itself. Records the gate's exit code in
# $GITHUB_OUTPUT (exit-code=N) and exits 0, so the reports are uploaded before the job fails.
set -uo pipefail

out="${INPUT_OUTPUT_DIR:-ddtree-diag}"
mkdir -p "$out"
args=(gate "${INPUT_MATRIX:-gate}" --junit "$out/junit.xml" --html "$out/report.html"
      --json "$out/report.json" --summary "$out/summary.md")
if [ -n "${INPUT_BASELINE:-}" ]; then
    args+=(--baseline "$INPUT_BASELINE")
fi
if [ -n "${INPUT_AGAINST:-}" ]; then
    args+=(--against "$INPUT_AGAINST")
fi
if [ -n "${INPUT_TARGETS:-}" ]; then
    args+=(--targets "$INPUT_TARGETS")
fi
if [ -z "${DDTREE_DIAG_URL:-}" ]; then
    unset DDTREE_DIAG_URL  # an empty url input is no --url (a fleet from targets)
fi
extra=()
if [ -n "${INPUT_ARGS:-}" ]; then
    split="$(mktemp)"
    if ! python3 -c 'import os, shlex, sys
sys.stdout.write("".join(a + "\0" for a in shlex.split(os.environ["INPUT_ARGS"])))' > "$split"; then
        echo "ddtree-diag action: cannot split the args input (unbalanced quotes?)" >&2
        echo "exit-code=2" >> "${GITHUB_OUTPUT:-/dev/null}"
        exit 0
    fi
    mapfile -d '' -t extra < "$split"
    rm -f "$split"
fi

ddtree-diag "${args[@]}" "${extra[@]}"
code=$?
echo "exit-code=$code" >> "${GITHUB_OUTPUT:-/dev/null}"
if [ ! -s "$out/summary.md" ] && [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then
    # Stopped before any case ran (bad matrix, unreachable server): say so in the job summary.
    printf '## ddtree-diag gate: error (exit %s)\n\nNo case ran: see the step log for the reason.\n' \
        "$code" >> "$GITHUB_STEP_SUMMARY"
fi
exit 0
