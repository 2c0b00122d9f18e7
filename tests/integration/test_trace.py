"""``infinity.trace``: one step of the tiny GPT on the nvme preset as a Chrome trace, its tracks, the order of
its events, nothing left behind when tracing is off, the file written whole, and the SVG drawn from it."""
from __future__ import annotations

import json
import os

import pytest
import torch

import infinity
from infinity import registry
from infinity.examples.data import batches
from infinity.plan import MachineProfile, probes
from infinity.timeline import record
from infinity.timeline.draw import draw
from infinity.timeline.record import KINDS, Timeline
from tests.support.gpt_runs import build


def _stepper(model, shape):
    opt = infinity.AdamW(model, lr=1e-3, weight_decay=0.1)
    data = batches("random", 4, 32, shape.vocab_size, seed=0)

    def step() -> float:
        x, y = next(data)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    return opt, step


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The third step of the tiny GPT (2 blocks, nvme preset) traced with a given NVMe bandwidth and no
    machine profile cached (the plan track's NVMe figures only)."""
    tmp = tmp_path_factory.mktemp("trace")
    model, shape = build(tmp / "nvme", "nvme", n_layer=2)
    opt, step = _stepper(model, shape)
    step()
    step()
    path = tmp / "step.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probes, "CACHE_PATH", tmp / "no-cache" / "machine.json")
        with infinity.trace(model, path, nvme_bandwidth=(2.0, 1.0)):
            step()
    assert not (tmp / "no-cache").exists()      # looked up, never probed
    yield json.loads(path.read_text()), path, model
    opt.synchronize()
    infinity.release(model)


def _spans(events, cat=None):
    return [e for e in events if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


def _end(e) -> float:
    return e["ts"] + e["dur"]


def test_a_traced_step_has_every_kind_of_event_on_its_own_track(traced):
    trace, _, _ = traced
    events = trace["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert set(processes.values()) == {"infinity step", "plan (predicted)"}
    for kind in KINDS:
        spans = _spans(events, kind)
        assert spans, f"no {kind} events"
        assert {threads[e["pid"], e["tid"]].rstrip("0123456789 ") for e in spans} == {kind}
    assert _spans(events, "plan"), "no predicted phases"
    assert any(e["name"].startswith("plan: NVMe read") and e["dur"] > 0 for e in _spans(events, "plan"))
    assert not any(e["name"].startswith("plan: forward") for e in _spans(events, "plan"))     # no profile
    names = {e["name"] for e in _spans(events)}
    assert {"forward blocks.0", "backward blocks.0", "gather blocks.0", "update sub 0", "opt.step()"} <= names
    assert any(n.startswith("read param blocks.") for n in names) and any(n == "write grad sub 0" for n in names)
    for e in _spans(events):
        assert e["dur"] >= 0 and e["ts"] >= 0 and (e["pid"], e["tid"]) in threads
    # Spans of one thread nest (a viewer stacks them): none ends inside another it started in.
    by_thread = {}
    for e in sorted(_spans(events), key=lambda e: (e["ts"], -e["dur"])):
        stack = by_thread.setdefault((e["pid"], e["tid"]), [])
        while stack and _end(stack[-1]) <= e["ts"] + 0.002:      # microseconds, rounded to 3 places
            stack.pop()
        assert not stack or _end(e) <= _end(stack[-1]) + 0.002, (e["name"], stack[-1]["name"])
        stack.append(e)


PROFILE = MachineProfile(name="test box", device_bytes=0, host_bytes=64 * 2**30, nvme_bytes=1e12, unified=True,
                         device_flops=2e10, host_adam_params_per_s=1e8, host_memory_gbps=10.0,
                         disk_read_gbps=2.0, disk_write_gbps=1.0)


def test_with_a_machine_profile_the_plan_track_has_the_predicted_phases(tmp_path):
    model, shape = build(tmp_path / "nvme", "nvme", n_layer=1)
    opt, step = _stepper(model, shape)
    step()
    step()
    path = tmp_path / "step.json"
    with infinity.trace(model, path, machine=PROFILE, workload=4 * 32):
        step()
    opt.synchronize()
    infinity.release(model)
    events = json.loads(path.read_text())["traceEvents"]
    plan = {e["name"].split()[1]: e for e in events if e.get("cat") == "plan"}
    mark = plan["step"]
    predicted = mark["args"]["phases_s"]
    assert mark["ph"] == "i" and mark["args"]["machine"] == "test box" and mark["args"]["tokens"] == 128
    assert mark["name"].endswith(f"({mark['args']['schedule']}; {mark['args']['governing']} governs)")
    fwd, bwd, upd = plan["forward"], plan["backward"], plan["update"]
    for name, e in (("forward", fwd), ("backward", bwd), ("update", upd)):
        assert e["dur"] == pytest.approx(predicted[name] * 1e6, abs=0.002), name
    # Laid end to end from the step's start, where the NVMe reads start too (at the profile's disk rate).
    read = next(e for e in _spans(events, "plan") if e["name"].startswith("plan: NVMe read"))
    assert read["name"].endswith("at 2 GB/s") and read["ts"] == fwd["ts"]
    assert bwd["ts"] == pytest.approx(_end(fwd), abs=0.002)
    update_after = fwd if mark["args"]["schedule"] == "update beside backward" else bwd
    assert upd["ts"] == pytest.approx(_end(update_after), abs=0.002)
    assert mark["ts"] == pytest.approx(fwd["ts"] + mark["args"]["step_s"] * 1e6, abs=0.002)


def test_without_a_workload_the_plan_track_takes_the_steps_tokens(tmp_path):
    """The plan's compute term is the traced step's (its first forward's token ids, 4 x 32), not
    ``Workload()``'s 16384 tokens; the hook that saw them is gone after the block."""
    model, shape = build(tmp_path / "nvme", "nvme", n_layer=1)
    opt, step = _stepper(model, shape)
    step()
    step()
    path = tmp_path / "step.json"
    before = _installed(model)
    with infinity.trace(model, path, machine=PROFILE):
        step()
    opt.synchronize()
    assert _installed(model) == before
    infinity.release(model)
    events = json.loads(path.read_text())["traceEvents"]
    mark = {e["name"].split()[1]: e for e in events if e.get("cat") == "plan"}["step"]
    assert mark["ph"] == "i" and mark["args"]["tokens"] == 128


def test_reads_end_before_compute_and_gradients_land_before_their_update(traced):
    events = traced[0]["traceEvents"]
    reads = _spans(events, "nvme read")
    writes = _spans(events, "nvme write")
    checked = {"forward": 0, "backward": 0}
    for compute in _spans(events, "compute"):
        phase, group = compute["name"].split(" ", 1)
        mine = [r for r in reads if r["name"] == f"read param {group}" and r["ts"] <= compute["ts"]]
        if mine:
            last = max(mine, key=lambda r: r["ts"])
            assert _end(last) <= compute["ts"], (compute["name"], last)
            checked[phase] += 1
    assert checked["forward"] and checked["backward"], checked
    updates = _spans(events, "update")
    (step,) = [u for u in updates if u["name"] == "opt.step()"]
    # This step's update (the one before it may still run as the trace begins: it overlaps the forward).
    subs = [u for u in updates if u["name"].startswith("update sub ") and u["ts"] >= step["ts"]]
    assert subs
    for u in subs:
        sub = u["name"].rsplit(" ", 1)[1]
        grads = [w for w in writes if w["name"] == f"write grad sub {sub}" and w["ts"] <= u["ts"]]
        assert grads, u
        assert all(_end(w) <= u["ts"] for w in grads), u
        states = [r for r in reads if r["name"].endswith(f" sub {sub}") and r["ts"] <= u["ts"]]
        assert states and all(_end(r) <= u["ts"] for r in states), u
        assert all(_end(c) <= u["ts"] for c in _spans(events, "compute") if c["name"].startswith("backward "))


def _installed(model) -> dict:
    """What hooks and instance attributes the engine's parts and the model's modules carry."""
    engine = registry.engine_of(model, "test")
    parts = {"engine": engine, "datapath": engine.datapath, "coordinator": engine.coordinator,
             "shards": engine.coordinator.shards, "store": engine.store}
    out = {name: sorted(vars(part)) for name, part in parts.items()}
    out["modules"] = [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
                      for m in model.modules()]
    out["optimizer"] = (len(engine.optimizer._optimizer_step_pre_hooks),
                        len(engine.optimizer._optimizer_step_post_hooks))
    return out


def test_tracing_off_leaves_nothing_and_the_losses_are_the_same(tmp_path):
    plain, shape = build(tmp_path / "a", "nvme", n_layer=1)
    _, plain_step = _stepper(plain, shape)
    model, shape = build(tmp_path / "b", "nvme", n_layer=1)
    opt, step = _stepper(model, shape)
    expected = [plain_step() for _ in range(4)]
    losses = [step(), step()]
    before = _installed(model)      # after the second step, which unhooks the modules without groups
    with infinity.trace(model, tmp_path / "step-{rank}.json") as timeline:
        assert _installed(model) != before      # the check below can see what a trace installs
        losses.append(step())
    assert json.loads((tmp_path / "step-0.json").read_text())["traceEvents"]
    assert _installed(model) == before
    recorded = len(timeline.spans)
    assert recorded
    losses.append(step())
    assert len(timeline.spans) == recorded     # nothing records outside the block
    assert losses == expected
    with infinity.gathered(plain), infinity.gathered(model):
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a, b)
    opt.synchronize()
    infinity.release(plain)
    infinity.release(model)


def test_a_block_that_raises_writes_nothing_and_removes_everything(traced, tmp_path):
    _, _, model = traced
    before = _installed(model)
    path = tmp_path / "never.json"
    with pytest.raises(RuntimeError, match="stop"):
        with infinity.trace(model, path):
            raise RuntimeError("stop")
    assert not path.exists()
    assert _installed(model) == before


def test_the_file_is_written_atomically(tmp_path, monkeypatch):
    timeline = Timeline()
    timeline.span("compute", "forward x", 0.0, 5.0)
    path = tmp_path / "step.json"
    path.write_text("the old trace")

    def refused(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(record.os, "replace", refused)
    with pytest.raises(OSError):
        timeline.write(path)
    assert path.read_text() == "the old trace"
    assert os.listdir(tmp_path) == ["step.json"]        # no temporary left behind
    monkeypatch.undo()
    timeline.write(path)
    assert [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"] == ["forward x"]
    assert os.listdir(tmp_path) == ["step.json"]


def test_the_drawing_is_the_same_svg_every_time(traced, tmp_path):
    _, path, _ = traced
    first, second = draw(path, tmp_path / "a.svg"), draw(path, tmp_path / "b.svg")
    svg = first.read_bytes()
    assert svg.startswith(b"<?xml") and b"<svg" in svg and svg == second.read_bytes()
    assert b"dc:date" not in svg
    for kind in KINDS:
        assert kind.encode() in svg


def test_the_overhead_benchmark_runs_at_a_tiny_size(tmp_path, capsys):
    from tests.support.benchmarks import load_benchmark

    out = tmp_path / "overhead.json"
    assert load_benchmark("step_trace").main(["--steps", "1", "--layers", "1", "--nvme", str(tmp_path / "nvme"),
                                              "--trace", str(tmp_path / "step.json"), "--json", str(out)]) == 0
    assert "traced" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert len(result["samples"]["plain_s"]) == len(result["samples"]["traced_s"]) == 1
    assert result["samples"]["spans"][0] > 0
    assert json.loads((tmp_path / "step.json").read_text())["traceEvents"]


def test_a_traced_step_under_dpu_trains_as_the_untraced_one(tmp_path):
    """DPU: the trace waits for the step's delayed update without publishing it. Its exit called
    ``opt.synchronize()``, which made that update current a step early: the traced run's next losses differed
    (and a trace on some ranks only would gather shards of two different steps)."""
    dpu = {"dpu": {"enabled": True, "warmup_steps": 1}}
    plain, shape = build(tmp_path / "a", "offload-host", n_layer=1, **dpu)
    _, plain_step = _stepper(plain, shape)
    model, shape = build(tmp_path / "b", "offload-host", n_layer=1, **dpu)
    opt, step = _stepper(model, shape)
    expected = [plain_step() for _ in range(5)]
    losses = [step(), step()]
    with infinity.trace(model, tmp_path / "step.json"):
        losses.append(step())
    losses += [step(), step()]
    assert losses == expected
    opt.synchronize()
    infinity.release(plain)
    infinity.release(model)
