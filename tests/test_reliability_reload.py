"""Model update without downtime: ReloadModel (admin RPC) and SIGHUP. The new model is checked
(metadata, sha256, session, warm-up, probe inference) before an atomic switch; requests admitted
before the switch answer from the old model; a bad model is refused and the old one keeps serving.
Which model answered is proven by `metadata.model_sha256` in every response."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from export.contract import FP32_TOLERANCE
from client import EncoderClient, build_request, parse_response
from serve.protocols.pb import pb_grpc
from tests.reliability_common import InProcessServer, copy_with_new_graph_bytes, corrupt_export, count, wait_until

ATOL = FP32_TOLERANCE["limit"]


def _sha(export_dir: Path) -> str:
    return json.loads((export_dir / "metadata.json").read_text())["graphs"]["fp32"]["sha256"]


def _ids(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100, length).astype(np.int64)


class Load:
    """Closed-loop clients recording (sha, ok) per call, to show no call fails across a switch."""

    def __init__(self, target: str, threads: int = 3) -> None:
        self.target, self.stop, self.seen, self.errors = target, threading.Event(), [], []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, seed: int) -> None:
        seq = _ids(11, seed)
        with EncoderClient(self.target, retries=0, timeout=30) as client:
            while not self.stop.is_set():
                try:
                    self.seen.append(client.encode([seq]).metadata.model_sha256)
                except grpc.RpcError as error:
                    self.errors.append(f"{error.code().name}: {error.details()}")

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


@pytest.fixture(scope="module")
def new_export(serve_export_dir, tmp_path_factory) -> Path:
    return copy_with_new_graph_bytes(serve_export_dir, tmp_path_factory.mktemp("new") / "export", "v2")


@pytest.fixture
def admin_server(serve_export_dir):
    server = InProcessServer(serve_export_dir, admin=True, max_queue_delay_ms=300.0)
    yield server
    server.stop()


def test_reload_rpc_switches_atomically_and_admitted_requests_finish_on_the_old_model(
        admin_server, serve_export_dir, new_export, serve_reference):
    old_sha, new_sha = _sha(serve_export_dir), _sha(new_export)
    assert old_sha != new_sha
    seqs = [_ids(6 + i, 200 + i) for i in range(3)]
    channel = grpc.insecure_channel(admin_server.target)
    stub = pb_grpc.EncoderServiceStub(channel)
    admitted = []
    real_swap = admin_server.server._swap_engine

    def swap_with_requests_in_flight(old, new):  # timing only: admit requests just before the switch
        ids, real_submit = set(), old.batcher.submit

        def submit(request, rows, *args, **kwargs):
            ticket = real_submit(request, rows, *args, **kwargs)
            ids.add(request.request_id)
            return ticket

        old.batcher.submit = submit
        admitted.extend(stub.Encode.future(build_request([s], request_id=f"inflight-{i}"), timeout=30)
                        for i, s in enumerate(seqs))
        assert wait_until(lambda: {f"inflight-{i}" for i in range(len(seqs))} <= ids, 10)  # in the old batcher
        return real_swap(old, new)

    admin_server.server._swap_engine = swap_with_requests_in_flight
    load = Load(admin_server.target)
    try:
        time.sleep(0.5)
        with EncoderClient(admin_server.target, timeout=60) as client:
            reply = client.reload_model(str(new_export))
            assert (reply.previous_sha256, reply.sha256) == (old_sha, new_sha)
            after = client.encode([seqs[0]])
        time.sleep(0.5)
    finally:
        load.finish()
        channel.close()
    # requests admitted before the switch answer from the old model, correctly
    for seq, future in zip(seqs, admitted):
        out = parse_response(future.result())
        assert out.metadata.model_sha256 == old_sha
        np.testing.assert_allclose(out.embeddings[0], serve_reference(seq)[1], atol=ATOL, rtol=ATOL)
    assert after.metadata.model_sha256 == new_sha
    np.testing.assert_allclose(after.embeddings[0], serve_reference(seqs[0])[1], atol=ATOL, rtol=ATOL)
    # no downtime: every call under load succeeded, first old then new, never back
    assert not load.errors, load.errors[:5]
    assert set(load.seen) == {old_sha, new_sha}
    with EncoderClient(admin_server.target) as client:
        assert client.model_info().sha256 == new_sha
    count(faults_survived=1)


@pytest.mark.parametrize("how,reason", [("truncated", "cannot load"), ("wrong_config", "probe inference"),
                                        ("missing_graph", "not found")])
def test_a_bad_new_model_is_refused_and_the_old_one_keeps_serving(admin_server, serve_export_dir, tmp_path,
                                                                  how, reason):
    old_sha = _sha(serve_export_dir)
    broken = corrupt_export(serve_export_dir, tmp_path / "broken", how)
    load = Load(admin_server.target, threads=2)
    try:
        with EncoderClient(admin_server.target, timeout=60) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.reload_model(str(broken))
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "reload refused" in caught.value.details() and reason in caught.value.details()
            assert old_sha in caught.value.details()
            assert client.encode([[1, 2, 3]]).metadata.model_sha256 == old_sha
    finally:
        load.finish()
    assert not load.errors and set(load.seen) == {old_sha}
    count(faults_survived=1)


def test_admin_service_is_off_unless_enabled(serve_export_dir):
    server = InProcessServer(serve_export_dir)
    try:
        with EncoderClient(server.target) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.reload_model("")
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop()


def _replace_export(dest: Path, source: Path) -> None:
    """Puts `source`'s files into `dest` (graph first, then metadata.json, each atomically)."""
    meta = json.loads((source / "metadata.json").read_text())
    graph = meta["graphs"]["fp32"]["file"]
    for name in (graph, "metadata.json"):
        tmp = dest / f".{name}.tmp"
        shutil.copyfile(source / name, tmp)
        os.replace(tmp, dest / name)


def test_sighup_reloads_the_export_dir_and_refuses_a_broken_one(serve_start, serve_export_dir, new_export,
                                                                tmp_path):
    served = tmp_path / "served"
    shutil.copytree(serve_export_dir, served)
    old_sha, new_sha = _sha(serve_export_dir), _sha(new_export)
    server = serve_start(served)
    load = Load(server.target, threads=2)
    try:
        time.sleep(0.3)
        _replace_export(served, new_export)
        server.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: load.seen and load.seen[-1] == new_sha, 30), server.log()
        assert "event=model_swapped" in server.log()
        # a broken export in place + SIGHUP: refused, the new model keeps serving
        broken = corrupt_export(new_export, tmp_path / "broken", "truncated")
        _replace_export(served, broken)
        server.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "event=sighup_reload_failed" in server.log(), 30), server.log()
        time.sleep(0.3)
    finally:
        load.finish()
    assert not load.errors, load.errors[:5]
    assert load.seen[-1] == new_sha and set(load.seen) == {old_sha, new_sha}
    assert "event=reload_refused" in server.log()
    assert server.terminate() == 0, server.log()
    count(faults_survived=2)
