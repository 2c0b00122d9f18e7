"""The pieces of the examples: shapes, data, config overrides, the step meter, the console."""
from __future__ import annotations

import io
import math

import pytest
import torch

from infinity.config import ConfigError
from infinity.examples import data
from infinity.examples.console import Progress, summary_table
from infinity.examples.gpt import GPT, PRESETS, GPTConfig, preset, shape_for_params
from infinity.examples.meter import StepMeter, StepRecord, format_bytes
from infinity.examples.train_gpt import TrainOptions, load_engine_config, options_from_args, parse_overrides


@pytest.mark.parametrize("name", ["tiny", "20M"])
def test_preset_param_count_is_exact(name):
    cfg = preset(name)
    assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.n_params


def test_large_presets_have_the_advertised_sizes():
    assert PRESETS["125M"].n_params == pytest.approx(124e6, rel=0.02)
    assert PRESETS["350M"].n_params == pytest.approx(355e6, rel=0.02)
    assert PRESETS["1.3B"].n_params == pytest.approx(1.31e9, rel=0.02)
    # The 4B preset's 16 B/param states are >= 2.5 x 24 GiB: it fits only with its states on NVMe.
    assert PRESETS["4B"].states_nbytes() >= 2.5 * 24 * 2**30


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="n_head .3. must divide d_model .64."):
        GPTConfig(n_layer=1, d_model=64, n_head=3)
    with pytest.raises(ValueError, match="GPTConfig.n_layer: expected a positive int, got 0"):
        GPTConfig(n_layer=0, d_model=64, n_head=4)
    with pytest.raises(ValueError, match="unknown model size '7B'; choose one of tiny, 20M"):
        preset("7B")


def test_shape_for_params_lands_near_the_target():
    for target in (1e8, 1e9, 4e9):
        cfg = shape_for_params(target)
        assert cfg.n_params == pytest.approx(target, rel=0.1)
        assert cfg.d_model % 128 == 0 and cfg.d_model // cfg.n_head == 64


def test_head_is_tied_to_the_token_embedding():
    model = GPT(preset("tiny"))
    assert not list(model.head.parameters())
    x = torch.randint(0, 512, (1, 8))
    model(x, x).backward()
    assert model.wte.weight.grad is not None and model.wte.weight.grad.abs().sum() > 0


def test_sequence_longer_than_the_position_table_is_refused():
    model = GPT(preset("tiny"))
    with pytest.raises(ValueError, match="sequence of 65 tokens is longer than seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_data_sources():
    x, y = next(data.batches("random", 2, 8, 100))
    assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 100
    rep = data.batches("repeat", 2, 8, 100)
    assert torch.equal(next(rep)[0], next(rep)[0])
    rnd = data.batches("random", 2, 8, 100)
    assert not torch.equal(next(rnd)[0], next(rnd)[0])
    assert not torch.equal(next(data.batches("random", 2, 8, 100, rank=0))[0],
                           next(data.batches("random", 2, 8, 100, rank=1))[0])
    tx, _ = next(data.batches("text", 1, 64, 256))
    assert data.corpus_tokens().numel() > 1000
    with pytest.raises(ValueError, match="needs vocab_size >= 256, got 100"):
        next(data.batches("text", 1, 8, 100))
    with pytest.raises(ValueError, match="data source 'web'"):
        next(data.batches("web", 1, 8, 100))


def test_overrides_parse_json_values_and_reject_malformed_keys():
    assert parse_overrides(["prefetch.enabled=false", "tiers.params=nvme", "aio.queue_depth=64"]) == {
        "prefetch": {"enabled": False}, "tiers": {"params": "nvme"}, "aio": {"queue_depth": 64}}
    with pytest.raises(ValueError, match="expected section.key=value"):
        parse_overrides(["prefetch=false"])


def test_engine_config_from_preset_flags_and_nvme_dir(tmp_path):
    opts = options_from_args(["--config", "nvme", "--nvme-dir", str(tmp_path / "s"), "--set", "dpu.enabled=true"])
    cfg = load_engine_config(opts)
    assert cfg.tiers.params == "nvme" and cfg.dpu.enabled and cfg.tiers.nvme_path == (str(tmp_path / "s"),)
    assert (tmp_path / "s").is_dir()
    with pytest.raises(ConfigError, match="prefetch"):
        load_engine_config(TrainOptions(config="nvme", overrides=("prefetch.enabeld=false",)))
    with pytest.raises(ValueError, match="--engine 'jax'"):
        TrainOptions(engine="jax")


def _record(step, seconds, stall=0.1, opt=0.2, loss=1.0):
    return StepRecord(step=step, loss=loss, tokens=100, seconds=seconds, compute_seconds=seconds - stall - opt,
                      stall_seconds=stall, optimizer_seconds=opt, rss_bytes=1 << 20, peak_rss_bytes=2 << 20,
                      tier_bytes={"nvme": 5 << 20}, tier_peak_bytes={"nvme": 6 << 20, "host": 0},
                      io_read_bytes=1000, io_write_bytes=500, hit_rate=0.5)


def test_meter_summary_skips_warmup_and_reports_the_median_step():
    meter = StepMeter(torch.nn.Linear(1, 1))
    meter.records[:] = [_record(1, 9.0, loss=5.0), _record(2, 1.0), _record(3, 3.0), _record(4, 2.0, loss=0.5)]
    s = meter.summary()
    assert s["steps_measured"] == 3 and s["step_seconds"] == 2.0
    assert s["compute_seconds"] + s["stall_seconds"] + s["optimizer_seconds"] == pytest.approx(2.0)
    assert s["tokens_per_second"] == pytest.approx(50.0)
    assert s["io_bytes_per_second"] == pytest.approx(3 * 1500 / 6.0)
    assert (s["first_loss"], s["last_loss"]) == (5.0, 0.5)
    assert s["tier_peak_bytes"] == {"nvme": 6 << 20, "host": 0}


def test_meter_on_a_plain_model_measures_time_only():
    model = torch.nn.Linear(4, 1)
    meter = StepMeter(model)
    meter.begin()
    model(torch.ones(2, 4)).sum().backward()
    meter.forward_backward_done()
    rec = meter.end(loss=0.0, tokens=2)
    assert rec.stall_seconds == 0.0 and rec.tier_bytes == {} and rec.hit_rate is None
    assert rec.seconds >= rec.compute_seconds >= 0 and rec.peak_rss_bytes >= rec.rss_bytes > 0


def test_progress_plain_lines_and_summary_table():
    stream = io.StringIO()
    bar = Progress(2, stream=stream, use_tqdm=False)
    bar.update(_record(1, 1.0))
    bar.update(_record(2, 2.0))
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("step    2/2") and "nvme 5.0 MiB" in lines[1]
    assert "stall 5%" in lines[1] and "tok/s" in lines[1]
    meter = StepMeter(torch.nn.Linear(1, 1))
    meter.records[:] = [_record(1, 1.0), _record(2, 2.0)]
    text = summary_table({"summary": meter.summary(), "model": {"size": "tiny", "n_params": 1e6},
                          "checkpoint": {"path": None, "note": "not written: reason"}, "json_path": "/x.json"})
    assert "waiting for reads (stall)" in text and "not written: reason" in text and "/x.json" in text
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(None) == "-" and format_bytes(3) == "3 B"


def test_flops_per_token_matches_6n_plus_attention():
    cfg = preset("125M")
    n = cfg.n_params - cfg.seq_len * cfg.d_model
    assert cfg.flops_per_token(128) == 6 * n + 12 * cfg.n_layer * cfg.d_model * 128
    assert math.isclose(cfg.flops_per_token(), 6 * n + 12 * 12 * 768 * 1024)
