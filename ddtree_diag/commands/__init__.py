"""The typer commands. Each module registers its commands on the app given to ``register``;
heavy modules (httpx, torch) are imported inside the command bodies so ``--help`` stays fast."""
