"""The tcp transport with the frontend on another host: the frontend worker runs in its own
network namespace (a test host this test makes, linked by a veth pair), reaches the mailbox
only through the tcp relay, and serves HTTP on its namespace's address."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import openai
import pytest

from nic_frontend.transports import tcp
from tests import fake_device as FD

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-story"


def _ip(*args: str) -> None:
  subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def netns():
  if os.geteuid() != 0 or shutil.which("ip") is None:
    pytest.skip("network namespaces need root and iproute2")
  tag = uuid.uuid4().hex[:6]
  ns, a, b = f"blinkfe{tag}", f"bv{tag}a", f"bv{tag}b"
  net = 100 + int(tag[:2], 16) % 100
  host_ip, ns_ip = f"10.231.{net}.1", f"10.231.{net}.2"
  try:
    _ip("netns", "add", ns)
  except subprocess.CalledProcessError as e:
    pytest.skip(f"cannot create a network namespace here: {e.stderr.decode().strip()}")
  try:
    _ip("link", "add", a, "type", "veth", "peer", "name", b)
    _ip("link", "set", b, "netns", ns)
    _ip("addr", "add", f"{host_ip}/30", "dev", a)
    _ip("link", "set", a, "up")
    _ip("netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", b)
    _ip("netns", "exec", ns, "ip", "link", "set", b, "up")
    _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
    yield ns, host_ip, ns_ip
  finally:
    subprocess.run(["ip", "link", "del", a], capture_output=True)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_frontend_in_another_namespace_serves_through_the_relay(netns, tmp_path,
                                                               tokenizer_path):
  with FD.running_device(tokenizer_path) as fake:
    _serve_through_the_relay(netns, tmp_path, tokenizer_path, fake)


def _serve_through_the_relay(netns, tmp_path, tok_path, fake):
  ns, host_ip, ns_ip = netns
  region, tok, story = fake.region, fake.tokenizer, fake.story
  relay = tcp.TcpRelayServer(region, token="ns-token", host=host_ip).start()
  proc = None
  try:
    proc, port, _ = FD.start_worker(
        tmp_path, tok_path, MODEL,
        ["--transport", "tcp", "--relay", relay.address, "--host", ns_ip],
        {"BLINK_RELAY_TOKEN": "ns-token"}, prefix=["ip", "netns", "exec", ns])
    client = openai.OpenAI(base_url=f"http://{ns_ip}:{port}/v1", api_key="unused")
    prompt = [2, 3, 4]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                  extra_body={"ignore_eos": True})
    want = [story[(len(prompt) + k) % len(story)] for k in range(6)]
    assert r.choices[0].text == tok.decode(want)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, stream=True, extra_body={"ignore_eos": True})
        if c.choices)
    assert streamed == r.choices[0].text
    with pytest.raises(openai.BadRequestError):
      client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, top_p=2.0)
    assert int(fake.device.header()["requests_finished"]) == 2
  finally:
    if proc is not None:
      proc.terminate()
      proc.wait(20)
    relay.stop()
