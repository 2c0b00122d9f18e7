"""infinity.config: defaults, sizes, strict keys, types, syntax errors, presets and round trips."""
from __future__ import annotations

import dataclasses
from typing import Annotated, get_args, get_origin, get_type_hints
import json
import os
import pickle
import subprocess
import sys
import pytest
import torch

from infinity import config
from infinity.config import sizes as _sizes, text as _config_text, toml_io as _toml
from infinity.config import Config, ConfigError, dump, load_config

MiB = 1 << 20

# The contract (notes/CONTRACTS.md), written out once more on purpose: a changed default must
# show up here as a failing test, not slip through.
CONTRACT_DEFAULTS = {
    "tiers": {"params": "device", "optimizer": "host", "optimizer_device_share": 0.0, "optimizer_host_share": 0.0,
              "nvme_path": (), "host_budget": 0, "device": "auto",
              "numa_node": None, "pin_memory": "auto", "pool_buffer_size": 64 * MiB, "pool_buffers": 8,
              "verify": False},
    "aio": {"block_size": 8 * MiB, "queue_depth": 32, "threads": 4, "engine": "auto", "direct": True},
    "precision": {"dtype": "float32", "cpu_linear": "native", "max_nonfinite_steps": 5, "loss_scale": "dynamic", "initial_scale": 2.0 ** 16,
                  "growth_interval": 2000, "hysteresis": 2, "min_scale": 1.0},
    "partition": {"stage": 3, "persistence_threshold": 0, "sub_group_size": 32 * MiB, "max_live_parameters": 0,
                  "gather_buffer_bytes": 0, "reduce_bucket_bytes": 0, "units": ()},
    "prefetch": {"enabled": True, "nvme_bytes": 256 * MiB, "device_bytes": 128 * MiB, "reuse_distance": 0,
                 "log_every": 0},
    "tiling": {"enabled": True, "threshold": 2**30, "tiles": 0, "max_tile_bytes": 256 * MiB, "modules": ()},
    "dpu": {"enabled": False, "warmup_steps": 5, "threads": 0, "overlap": True},
    "checkpoint": {"buffer_size": 64 * MiB},
}


def error_of(src, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(src, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("section", sorted(CONTRACT_DEFAULTS))
def test_every_section_defaults_match_the_contract(section):
    got = getattr(Config(), section)
    assert {f.name: getattr(got, f.name) for f in dataclasses.fields(got)} == CONTRACT_DEFAULTS[section]


def test_defaults_are_the_same_from_every_source(tmp_path):
    (tmp_path / "empty.toml").write_text("")
    (tmp_path / "empty.json").write_text("{}")
    assert load_config() == load_config({}) == load_config(tmp_path / "empty.toml") == load_config(
        str(tmp_path / "empty.json")) == Config()


def test_every_field_has_a_docstring():
    for section in config.SECTIONS:
        docs = _config_text.field_docs(section)
        missing = [f.name for f in dataclasses.fields(section) if not docs.get(f.name)]
        assert not missing, f"{section.section}: fields without a docstring: {missing}"
        assert section.__doc__


def test_sections_are_frozen_and_hashable():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.aio.queue_depth = 1  # type: ignore[misc]
    assert hash(cfg) == hash(Config())


def test_precision_dtype_and_itemsize():
    import torch

    assert load_config({"precision": {"dtype": "bfloat16"}}).precision.torch_dtype is torch.bfloat16
    assert Config().precision.itemsize == 4


def test_importing_infinity_and_loading_a_config_does_not_import_torch():
    code = "import sys, infinity; infinity.load_config('nvme'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, nbytes", [
    ("64MiB", 64 * MiB), ("1.5 GB", 1_500_000_000), ("4096", 4096), (4096, 4096), ("4 KiB", 4096),
    ("1TB", 10**12), ("2tib", 2 << 40), ("8192B", 8192), ("0.5MiB", MiB // 2), ("1e3KB", 10**6), (0, 0), (1e9, 10**9),
])
def test_sizes_in_bytes(text, nbytes):
    assert load_config({"tiers": {"host_budget": text}}).tiers.host_budget == nbytes


@pytest.mark.parametrize("text, numel", [("32Mi", 32 * MiB), (1e9, 10**9), ("1.5K", 1500), ("2G", 2 * 10**9), (7, 7)])
def test_element_counts(text, numel):
    assert load_config({"partition": {"sub_group_size": text}}).partition.sub_group_size == numel


@pytest.mark.parametrize("value, reason", [
    ("12 parsecs", "unknown unit 'parsecs'"),
    ("4k", "unit 'k' is ambiguous for bytes; write KiB (powers of 1024) or KB (powers of 1000)"),
    ("4Mi", "unit 'Mi' counts elements; for bytes write MiB"),
    ("1.1 B", "is not a whole number of bytes"),
    ("-1MiB", "must not be negative"),
    (-1, "must not be negative"),
    (True, "expected an integer number of bytes"),
    (1.5, "is not a whole number of bytes (1.5)"),
    (float("nan"), "expected an integer number of bytes"),
    ("lots", "not a number and a unit"),
])
def test_bad_sizes_name_key_value_and_allowed(value, reason):
    message = error_of({"aio": {"block_size": value}})
    assert message.startswith(f"aio.block_size: {json.dumps(value)} is not a valid size in bytes: ")
    assert reason in message


def test_bad_element_count():
    message = error_of({"partition": {"sub_group_size": "32 MiB"}})
    assert message.startswith('partition.sub_group_size: "32 MiB" is not a valid element count: unknown unit')


def test_format_size_round_trips():
    for nbytes in (0, 1, 4095, 4096, 4097, 64 * MiB, 3 << 40, 1_500_000_000):
        assert _sizes.parse_size(_sizes.format_size(nbytes)) == nbytes
        assert _sizes.parse_count(_sizes.format_count(nbytes)) == nbytes


# ---------------------------------------------------------------------------------------------- unknown keys


def test_unknown_key_in_a_section_suggests_the_closest(tmp_path):
    path = tmp_path / "offload.toml"
    path.write_text("[aio]\nqueue_dept = 8\n")
    assert error_of(path) == f"{path}: aio.queue_dept: unknown key; did you mean aio.queue_depth?"


def test_unknown_section_suggests_the_closest():
    assert error_of({"tier": {"params": "host"}}) == "tier: unknown section; did you mean tiers?"


def test_key_at_top_level_points_into_its_section():
    assert error_of({"nvme_path": "/x"}) == (
        "nvme_path: unknown section; did you mean tiers.nvme_path? (settings go inside a [section])")


def test_key_in_the_wrong_section_points_to_the_right_one():
    assert error_of({"aio": {"nvme_path": "/x"}}) == "aio.nvme_path: unknown key; did you mean tiers.nvme_path?"


def test_nested_table_inside_a_section_is_an_unknown_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[prefetch.nvme]\nbytes = 3\n")
    assert error_of(path) == f"{path}: prefetch.nvme: unknown key; did you mean prefetch.nvme_bytes?"


def test_unknown_key_without_a_close_match_lists_the_valid_ones():
    assert error_of({"dpu": {"zzz": 1}}) == "dpu.zzz: unknown key; valid keys in [dpu] are enabled, warmup_steps, threads, overlap"


def test_every_unknown_key_is_reported_at_once():
    message = error_of({"aio": {"queue_dept": 1, "treads": 2}, "tilling": {}})
    assert message.splitlines() == ["aio.queue_dept: unknown key; did you mean aio.queue_depth?",
                                    "aio.treads: unknown key; did you mean aio.threads?",
                                    "tilling: unknown section; did you mean tiling?"]


def test_deepspeed_config_is_recognised():
    assert "infinity.config.from_deepspeed" in error_of({"zero_optimization": {"stage": 3}})


def test_unknown_keys_in_overrides_and_in_mapping_sections():
    assert error_of("device", overrides={"aio": {"depth": 1}}).endswith("aio.depth: unknown key; did you mean aio.queue_depth?")
    with pytest.raises(ConfigError, match=r"^aio.queue_dept: unknown key"):
        Config(aio={"queue_dept": 3})


# ---------------------------------------------------------------------------------------------- types and values


@pytest.mark.parametrize("data, message", [
    ({"tiers": {"params": "gpu"}}, 'tiers.params: "gpu" is not allowed; expected one of "device", "host", "nvme"'),
    ({"tiers": {"params": "Host"}}, '"Host" is not allowed; expected one of "device", "host", "nvme", "auto"; did you mean "host"?'),
    ({"tiers": {"optimizer": "gpu"}}, 'tiers.optimizer: "gpu" is not allowed; expected one of "device", "host", "nvme"'),
    ({"aio": {"direct": "yes"}}, 'aio.direct: expected true or false, got "yes" (string)'),
    ({"aio": {"queue_depth": "32"}}, 'aio.queue_depth: expected an integer, got "32" (string)'),
    ({"aio": {"queue_depth": 8.0}}, "aio.queue_depth: expected an integer, got 8.0 (float)"),
    ({"aio": {"queue_depth": 0}}, "aio.queue_depth: expected an integer >= 1, got 0"),
    ({"aio": {"threads": True}}, "aio.threads: expected an integer, got true (boolean)"),
    ({"aio": {"block_size": "1000B"}}, "aio.block_size: 1000 bytes is not a positive multiple of 4096"),
    ({"aio": 3}, "aio: expected a table of settings, got 3 (integer)"),
    ({"aio": {"engine": ["io_uring"]}}, 'aio.engine: ["io_uring"] is not allowed; expected one of "auto", "io_uring", "threads"'),
    ({"tiers": {"params": {"x": 1}}}, 'tiers.params: a table {"x": 1} is not allowed'),
    ({"tiers": {"nvme_path": 7}}, "tiers.nvme_path: expected a path or a list of paths (non-empty strings), got 7 (integer)"),
    ({"tiers": {"nvme_path": ["/a", ""]}}, "tiers.nvme_path: expected a path or a list of paths"),
    ({"tiers": {"nvme_path": ["/a", "/a"]}}, 'tiers.nvme_path: ["/a", "/a"] names an entry twice'),
    ({"tiers": {"params": "nvme"}}, 'tiers.nvme_path: required when tiers.params is "nvme"'),
    ({"tiers": {"optimizer": "nvme"}}, 'tiers.nvme_path: required when tiers.optimizer is "nvme"'),
    ({"tiers": {"numa_node": "near"}}, 'tiers.numa_node: expected a NUMA node number >= 0 or "auto", got "near" (string)'),
    ({"tiers": {"numa_node": -2}}, "tiers.numa_node: expected a NUMA node number >= 0"),
    ({"tiers": {"pool_buffers": 0}}, "tiers.pool_buffers: expected an integer >= 1, got 0"),
    ({"tiling": {"modules": [1]}}, "tiling.modules: expected a string or a list of strings"),
    ({"tiling": {"threshold": 0}}, "tiling.threshold: expected an element count >= 1, got 0 elements"),
    ({"dpu": {"warmup_steps": -1}}, "dpu.warmup_steps: expected an integer >= 0, got -1"),
    ({"precision": {"loss_scale": 0}}, 'precision.loss_scale: expected "dynamic" or a positive number, got 0'),
    ({"precision": {"loss_scale": "auto"}}, 'precision.loss_scale: expected "dynamic" or a positive number, got "auto"'),
    ({"precision": {"loss_scale": 2.0 ** 70}}, "precision.loss_scale: expected a number >= 5.96046e-08 and <= 1.84467e+19"),
    ({"precision": {"initial_scale": "big"}}, 'precision.initial_scale: expected a finite number, got "big" (string)'),
    ({"precision": {"initial_scale": 0}}, "precision.initial_scale: expected a number >= 5.96046e-08"),
    ({"precision": {"min_scale": 1024, "initial_scale": 512}}, "precision.min_scale: expected a number >= "
                                                                "5.96046e-08 and <= 512, got 1024: at most initial_scale"),
    ({"precision": {"growth_interval": 0}}, "precision.growth_interval: expected an integer >= 1, got 0"),
    ({"precision": {"hysteresis": 0}}, "precision.hysteresis: expected an integer >= 1, got 0"),
    ({"checkpoint": {"buffer_size": "6000B"}}, "checkpoint.buffer_size: 6000 bytes is not a positive multiple of 4096"),
    ([1, 2], "expected a path, a preset name, a dict or a Config, got list"),
])
def test_wrong_types_and_values_name_key_value_and_allowed(data, message):
    assert message in error_of(data)


def test_values_are_coerced():
    cfg = load_config({"tiers": {"nvme_path": "~/swap", "numa_node": "auto"}, "tiling": {"modules": "blocks.*"}})
    assert cfg.tiers.nvme_path[0].endswith("/swap") and not cfg.tiers.nvme_path[0].startswith("~")
    assert cfg.tiers.numa_node == -1 and cfg.tiling.modules == ("blocks.*",)
    assert config.AioConfig(block_size="4MiB").block_size == 4 * MiB
    with pytest.raises(ConfigError, match=r"^aio.block_size: \"4k\""):
        config.AioConfig(block_size="4k")


def test_config_error_is_a_value_error_that_pickles():
    err = ConfigError("bad", "aio.threads", "x.toml")
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, ValueError) and str(again) == "x.toml: aio.threads: bad" and again.key == "aio.threads"


# ---------------------------------------------------------------------------------------------- files


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[aio]\nqueue_depth = 8\nblock_size 4MiB\n")
    message = error_of(path)
    assert message.startswith(f"{path}: TOML syntax error at line 3, column ")


def test_json_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "aio": {\n    "queue_depth": 8,\n  }\n}\n')
    assert error_of(path).startswith(f"{path}: JSON syntax error at line 4, column 3: ")


def test_json_duplicate_key_and_non_object(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"aio": {"threads": 1, "threads": 2}}')
    assert error_of(path) == f"{path}: key 'threads' appears twice in one JSON object"
    path.write_text("[1]")
    assert error_of(path) == f"{path}: expected a JSON object of sections at the top, got list"


def test_errors_raised_without_chained_tracebacks(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("x = = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert info.value.file == str(path)


def test_missing_file_and_wrong_suffix(tmp_path):
    assert error_of(tmp_path / "nope.toml") == f"{tmp_path / 'nope.toml'}: no such file"
    (tmp_path / "c.yaml").write_text("aio: {}\n")
    assert "expected a .toml or .json file" in error_of(tmp_path / "c.yaml")
    (tmp_path / "dir.toml").mkdir()
    assert error_of(tmp_path / "dir.toml").startswith(f"{tmp_path / 'dir.toml'}: cannot read")
    with pytest.raises(ConfigError, match=r"no preset named 'nvmee'; did you mean 'nvme'\?"):
        load_config("nvmee")        # a misspelt preset: no longer "expected a .toml or .json file"


def test_value_error_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"tiers": {"params": "gpu"}}))
    assert error_of(path).startswith(f'{path}: tiers.params: "gpu" is not allowed')


# ---------------------------------------------------------------------------------------------- presets, dump


def test_the_five_presets_ship():
    assert set(config.presets()) == {"device", "offload-optimizer", "offload-host", "nvme", "auto"}
    tiers = {name: (load_config(name).tiers.params, load_config(name).tiers.optimizer) for name in config.presets()}
    assert tiers == {"device": ("device", "device"), "offload-optimizer": ("device", "host"),
                     "offload-host": ("host", "host"), "nvme": ("nvme", "nvme"), "auto": ("auto", "auto")}


def test_presets_are_documented_with_comments():
    for name in config.presets():
        text = config.preset_path(name).read_text()
        assert text.startswith(f'# Preset "{name}"'), name
        assert len([line for line in text.splitlines() if line.startswith("#")]) >= 5, name


@pytest.mark.parametrize("name", ["device", "offload-optimizer", "offload-host", "nvme", "auto"])
@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_every_preset_round_trips(name, suffix, tmp_path):
    cfg = load_config(name)
    path = dump(cfg, tmp_path / f"{name}{suffix}")
    assert load_config(path) == cfg
    assert load_config(cfg.to_dict()) == cfg
    json.dumps(cfg.to_dict())  # plain and JSON-able


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_non_default_values_round_trip(suffix, tmp_path):
    cfg = load_config({
        "tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": ['/mnt/a "quoted"\\dir', "/mnt/ü b"],
                  "numa_node": "auto", "host_budget": "1.5GB", "pin_memory": "never", "pool_buffer_size": "4KiB"},
        "aio": {"block_size": 4096 * 3, "engine": "threads", "direct": False},
        "precision": {"dtype": "float16", "loss_scale": 128, "initial_scale": 1024, "min_scale": 0.5,
                      "hysteresis": 1, "growth_interval": 7},
        "partition": {"sub_group_size": 1_000_001, "persistence_threshold": "1Ki"},
        "tiling": {"modules": ["a.*", "b\nc"], "tiles": 3},
        "dpu": {"enabled": True},
    })
    assert load_config(dump(cfg, tmp_path / f"c{suffix}")) == cfg


def test_dump_writes_readable_sizes_and_validates_dicts(tmp_path):
    text = dump({"aio": {"queue_depth": 8}}, tmp_path / "c.toml").read_text()
    assert 'block_size = "8MiB"' in text and "queue_depth = 8" in text and "numa_node" not in text
    with pytest.raises(ConfigError, match="aio.queue_dept: unknown key"):
        dump({"aio": {"queue_dept": 8}}, tmp_path / "bad.toml")
    assert not (tmp_path / "bad.toml").exists()
    with pytest.raises(ConfigError, match="expected a .toml or .json file name"):
        dump(Config(), tmp_path / "c.yaml")


def test_overrides_and_preset_names():
    cfg = load_config("nvme", overrides={"tiers": {"nvme_path": ["/x", "/y"]}, "aio": {"queue_depth": 4}})
    assert cfg.tiers.nvme_path == ("/x", "/y") and cfg.aio.queue_depth == 4 and cfg.tiers.params == "nvme"
    assert load_config(cfg) is cfg
    assert load_config(cfg, overrides={"dpu": {"enabled": True}}).dpu.enabled
    assert "did you mean 'nvme'?" in str(pytest.raises(ConfigError, config.preset_path, "nvmee").value)


def test_nvme_path_is_given_beside_the_preset(tmp_path):
    """The preset's placeholder path could be replaced only through overrides={"tiers": {...}}."""
    assert load_config("nvme", nvme_path=tmp_path).tiers.nvme_path == (str(tmp_path),)
    assert load_config("nvme", nvme_path=[tmp_path / "a", "/b"]).tiers.nvme_path == (str(tmp_path / "a"), "/b")
    assert load_config("nvme", nvme_path=str(tmp_path), overrides={"aio": {"queue_depth": 4}}).aio.queue_depth == 4
    assert load_config({"tiers": {"params": "nvme", "nvme_path": tmp_path}}).tiers.nvme_path == (str(tmp_path),)
    assert error_of("nvme", nvme_path="/x", overrides={"tiers": {"nvme_path": "/y"}}) == (
        "tiers.nvme_path: given twice, as nvme_path= and in overrides; give it once")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert error_of("nvme", nvme_path=afile).startswith(f"the nvme_path argument: tiers.nvme_path: '{afile}' is a file")


def test_the_nvme_presets_path_is_the_placeholder_its_error_names():
    from infinity.config import paths

    assert load_config("nvme").tiers.nvme_path == (paths.PRESET_PLACEHOLDER,)


def test_a_directory_named_like_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    """The swap files' directory is often ./nvme: load_config("nvme") read it as the config file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvme").mkdir()
    assert load_config("nvme").tiers.params == "nvme"
    (tmp_path / "device").write_text("")      # a file of that name is what the user means: refused, named
    with pytest.raises(ConfigError, match="expected a .toml or .json file"):
        load_config("device")


def test_toml_writer_escapes_and_quotes():
    data = {"top": 1, "a b": {"s": 'q"\\\n\tü', "f": 1.5, "t": True, "l": [1, "x"], "none": None}, "n": {"m": {"k": 2}}}
    text = _toml.dumps(data)
    assert _toml.loads(text) == {"top": 1, "a b": {"s": 'q"\\\n\tü', "f": 1.5, "t": True, "l": [1, "x"]},
                                   "n": {"m": {"k": 2}}}


def test_auto_device_follows_infinity_device_and_names_a_bad_value(monkeypatch):
    from infinity.config.sections import resolve_device
    from infinity.runtime.device import ComputeDevice

    assert os.environ["INFINITY_DEVICE"] == "cpu"      # tests/conftest.py: tests compute on the CPU
    assert Config().tiers.compute_device() == "cpu" and ComputeDevice("auto").device.type == "cpu"
    assert load_config(None, overrides={"tiers": {"device": "cpu"}}).tiers.compute_device() == "cpu"
    monkeypatch.delenv("INFINITY_DEVICE")
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("INFINITY_DEVICE", "gpu")
    with pytest.raises(ConfigError, match=r"tiers.device: the environment variable INFINITY_DEVICE='gpu' is not"):
        Config().tiers.compute_device()
    assert resolve_device("cpu") == "cpu"          # an explicit setting is not overridden
    if not torch.cuda.is_available():
        monkeypatch.setenv("INFINITY_DEVICE", "cuda")
        with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
            ComputeDevice("auto")


# ---------------------------------------------------------------------------------------------- ranges


def _numeric_keys():
    for section in config.SECTIONS:
        hints = get_type_hints(section, include_extras=True)
        for f in dataclasses.fields(section):
            hint = hints[f.name]
            base = get_args(hint)[0] if get_origin(hint) is Annotated else hint
            if base is int or "Optional[int]" in str(base) or base == (int | None):
                yield section.section, f.name


@pytest.mark.parametrize("section, key", list(_numeric_keys()))
def test_every_numeric_key_has_a_range_whose_error_names_key_file_and_reason(tmp_path, section, key):
    path = tmp_path / "big.toml"
    path.write_text(f"[{section}]\n{key} = {2**62}\n")
    message = error_of(path)
    assert message.startswith(f"{path}: {section}.{key}: expected "), message
    assert f"got {2**62}" in message and ": " in message.split(f"got {2**62}", 1)[1], message   # the reason
    below = error_of({section: {key: -2}})      # sizes and counts refuse it as they parse it
    assert below.startswith(f"{section}.{key}: ") and "-2" in below, below


@pytest.mark.parametrize("data, message", [
    ({"aio": {"queue_depth": 10**20}}, "aio.queue_depth: expected an integer <= 4096, got 100000000000000000000: "
                                       "at least one request"),
    ({"aio": {"threads": 100000}}, "aio.threads: expected an integer <= 256, got 100000: "),
    ({"aio": {"block_size": "16TiB"}}, "aio.block_size: expected a size <= 1GiB, got 17592186044416 bytes: "
                                       "one read or write; Linux moves at most 2GiB - 4KiB per call"),
    ({"tiers": {"pool_buffer_size": "8GiB"}}, "tiers.pool_buffer_size: expected a size <= 4GiB"),
    ({"tiers": {"pool_buffer_size": "1GiB", "pool_buffers": 1000}},
     "tiers.pool_buffers: 1000 x 1GiB = 1000.0 GiB of pinned host memory is taken when the engine starts"),
    ({"checkpoint": {"buffer_size": "1TiB"}}, "checkpoint.buffer_size: expected a size <= 4GiB"),
    ({"partition": {"sub_group_size": "1T"}}, "partition.sub_group_size: expected an element count <= 4Gi, "
                                              "got 1000000000000 elements: "),
])
def test_out_of_range_values_are_refused_with_the_bound_and_why(data, message):
    assert message in error_of(data)


def test_an_error_in_an_override_names_the_override_not_the_file(tmp_path):
    """It blamed the preset file, which does not hold the key."""
    with pytest.raises(ConfigError, match=r"^overrides: tiers.host_budget: \"4k\" is not a valid size"):
        load_config("nvme", overrides={"tiers": {"host_budget": "4k"}})
    with pytest.raises(ConfigError, match=r"^overrides: tiers.parmas: unknown key; did you mean tiers.params"):
        load_config("offload-host", overrides={"tiers": {"parmas": "host"}})
    bad = tmp_path / "bad.toml"
    bad.write_text('[aio]\nqueue_depth = 0\n')
    with pytest.raises(ConfigError, match=rf"^{bad} \(with overrides\): aio.queue_depth"):
        load_config(bad, overrides={"tiers": {"params": "host"}})


def test_config_files_that_are_no_config_files_are_refused_quickly(tmp_path):
    """A config nested 100,000 deep gave a bare RecursionError; /dev/zero was read without end (10.7 GB in
    30 s); a FIFO blocked forever. Each is now one ConfigError naming the file."""
    import os

    from infinity.config.values import ConfigError

    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    deep_toml = tmp_path / "deep.toml"
    deep_toml.write_text("a = " + "[" * 100_000 + "]" * 100_000)
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * (2 << 20))
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)
    dev = tmp_path / "zero.toml"
    os.symlink("/dev/zero", dev)
    for path, said in ((deep_json, "nested too deeply"), (deep_toml, "nested too deeply"),
                       (big, "larger than 1024 KiB"), (fifo, "not a regular file"), (dev, "not a regular file")):
        with pytest.raises(ConfigError, match=said) as info:
            load_config(str(path))
        assert str(path) in str(info.value), (path, info.value)
