"""The STAND-IN server's ``--replicas N`` (tests/support/standin_server.py): one process, N
identical servers on N loopback ports (the fleet benchmark's fleet, bench/bench_fleet.py)."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest

from tests.support.processes import STANDIN

pytestmark = pytest.mark.e2e  # starts the stand-in as a real process


def test_replicas_print_their_ports_and_each_one_answers():
    process = subprocess.Popen([sys.executable, str(STANDIN), "--dialect", "ddtree", "--replicas", "3"],
                               stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("PORTS "), line
        ports = [int(p) for p in line.split()[1:]]
        assert len(ports) == 3 and len(set(ports)) == 3
        for port in ports:
            url = f"http://127.0.0.1:{port}"
            models = httpx.get(f"{url}/v1/models", timeout=10)
            assert models.status_code == 200
            assert models.json()["data"][0]["id"] == "standin-model"
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
                "model": "standin-model", "max_tokens": 16, "temperature": 0, "tree_budget": 16,
                "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
            })
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == "Hello! It is nice to meet you."
        # identical replicas share one State: any replica's log holds every replica's requests
        logged = httpx.get(f"http://127.0.0.1:{ports[0]}/_requests", timeout=10).json()
        assert len([r for r in logged if r.get("max_tokens") == 16]) == 3
    finally:
        process.terminate()
        process.wait(timeout=10)
    for port in ports:  # ending the process stopped every replica
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_one_replica_keeps_the_single_port_line():
    process = subprocess.Popen([sys.executable, str(STANDIN), "--replicas", "1", "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("PORT ") and len(line.split()) == 2, line
    finally:
        process.terminate()
        process.wait(timeout=10)
