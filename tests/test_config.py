"""The `etblocks` YAML config: parsing, merging with flags, and every error."""

from __future__ import annotations

import pytest

from etblocks.config import load_config, parse_config, resolve
from etblocks.options import OPTIONS
from etblocks.errors import ConfigError, EtblocksError

FULL = """\
# every option
model: demo
backend: portable
out: build/model.pte
max_seq_len: 64
verify: false
sdpa: dynamic
pte: other.pte
prompt_ids: [1, 2, 3]
max_new_tokens: 8
temperature: 0.7
top_p: 0.9
seed: 3
tokenizer: tok.json
"""


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_full_file_parses_with_types_and_lines(tmp_path):
    config = load_config(write(tmp_path, FULL))
    assert config.values == {
        "model": "demo",
        "backend": "portable",
        "out": "build/model.pte",
        "max_seq_len": 64,
        "verify": False,
        "sdpa": "dynamic",
        "pte": "other.pte",
        "prompt_ids": [1, 2, 3],
        "max_new_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "tokenizer": "tok.json",
    }
    assert config.lines["model"] == 2 and config.lines["tokenizer"] == 14
    assert isinstance(config.values["temperature"], float)


def test_every_flag_has_a_key():
    flags = {flag for o in OPTIONS.values() for flag in o.flags}
    assert {"--model", "--backend", "--out", "--max-seq-len", "--sdpa", "--pte", "--prompt-ids", "--prompt"} <= flags
    assert {"--tokenizer", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--verify", "--no-verify"} <= flags


def test_prompt_ids_as_string_and_int_temperature():
    config = parse_config("prompt_ids: '4, 5,6'\ntemperature: 1\n")
    assert config.values["prompt_ids"] == [4, 5, 6]
    assert config.values["temperature"] == 1.0 and isinstance(config.values["temperature"], float)


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "seed:\nmodel: null\n"])
def test_empty_file_and_nulls_set_nothing(text):
    assert parse_config(text).values == {}


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml.*does not exist.*accepted keys: .*max_seq_len"):
        load_config(tmp_path / "nope.yaml")


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_invalid_yaml_names_line_and_column(tmp_path):
    path = write(tmp_path, "model: demo\nbackend: xnnpack: portable\n")
    with pytest.raises(ConfigError, match=r"config\.yaml' is not valid YAML, line 2, column 17: mapping values"):
        load_config(path)


def test_tab_indentation_is_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"not valid YAML, line 2"):
        load_config(write(tmp_path, "model: demo\n\tbackend: xnnpack\n"))


def test_unknown_key_names_line_suggestion_and_accepted(tmp_path):
    path = write(tmp_path, "model: demo\nmax_seqlen: 64\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "line 2" in message and "'max_seqlen'" in message
    assert "did you mean 'max_seq_len'?" in message
    assert "accepted keys:" in message and "max_new_tokens" in message and "tokenizer" in message


def test_every_problem_of_a_file_is_reported_at_once():
    text = "model: demo\nmax_len: 32\nbakend: xnnpack\ntop_p: 2\nmodel: x\nsdpa: custom\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, "c.yaml")
    assert str(info.value).startswith(
        "config file 'c.yaml', line 2: unknown key 'max_len' (did you mean 'max_seq_len'?); "
        "line 3: unknown key 'bakend' (did you mean 'backend'?); line 4: top_p=2 (int) is not accepted; give a number "
        "in (0, 1]; line 5: key 'model' is given twice (first on line 1); accepted keys: "
    )


def test_non_string_key_is_unknown():
    with pytest.raises(ConfigError, match="line 1: unknown key 1"):
        parse_config("1: 2\n")


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("max_seq_len: abc\n", r"line 1: max_seq_len='abc' \(str\) is not accepted; give an integer >= 2"),
        ("max_seq_len: 1\n", r"max_seq_len=1 \(int\) is not accepted; give an integer >= 2"),
        ("max_seq_len: 32.5\n", r"max_seq_len=32.5 \(float\)"),
        ("max_new_tokens: true\n", r"max_new_tokens=True \(bool\) is not accepted; give an integer >= 1"),
        ("verify: 1\n", r"verify=1 \(int\) is not accepted; give true or false"),
        ("sdpa: fast\n", r"sdpa='fast' \(str\) is not accepted; choose one of \['custom', 'dynamic', 'static'\]"),
        ("top_p: 1.5\n", r"top_p=1.5 \(float\) is not accepted; give a number in \(0, 1\]"),
        ("top_p: 0\n", r"top_p=0"),
        ("temperature: -1\n", r"temperature=-1 .*give a number >= 0"),
        ("temperature: hot\n", r"temperature='hot'"),
        ("seed: -3\n", r"seed=-3"),
        ("prompt_ids: [1, -2]\n", r"prompt_ids=\[1, -2\] \(list\) is not accepted; give a non-empty list of token ids"),
        ("prompt_ids: []\n", r"prompt_ids=\[\]"),
        ("prompt_ids: '1,x'\n", r"prompt_ids='1,x'"),
        ("prompt_ids: [true]\n", r"prompt_ids=\[True\]"),
        ("model: ''\n", r"model='' \(str\) is not accepted; give a non-empty string"),
        ("model: 3\n", r"model=3 \(int\)"),
        ("out: [a.pte]\n", r"out=\['a.pte'\] \(list\) is not accepted; give a path"),
        ("quantize_weights: int4\n", r"quantize_weights='int4' \(str\) is not accepted; choose one of \['4bit', '8bit', '8da4w', '8da8w', 'none'\]"),
        ("quantize_activations: 8\n", r"quantize_activations=8 \(int\) is not accepted; give a scheme"),
        ("qnn_chipset: SM0000\n", r"qnn_chipset='SM0000' \(str\) is not accepted; choose one of ExecuTorch's QcomChipset names \[.*'SM8650'"),
        ("dtype: int8\n", r"dtype='int8' \(str\) is not accepted; give a floating dtype"),
        ("group_size: 0\n", r"group_size=0 \(int\) is not accepted; give an integer >= 1"),
        ("quantize_embedding: int4\n", r"quantize_embedding='int4' \(str\) is not accepted; choose one of \['int8', 'none'\]"),
        ("kv_quantize: fp8\n", r"kv_quantize='fp8' \(str\) is not accepted; choose one of \['int8', 'none'\]"),
    ],
)
def test_wrong_values_name_key_value_line_and_accepted(text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_config(text, "c.yaml")


def test_wrong_value_reports_its_own_line():
    with pytest.raises(ConfigError, match=r"'c.yaml', line 3: seed='x'"):
        parse_config("model: demo\nbackend: xnnpack\nseed: x\n", "c.yaml")


def test_duplicate_key():
    with pytest.raises(ConfigError, match=r"line 3: key 'backend' is given twice \(first on line 1\)"):
        parse_config("backend: xnnpack\nmodel: demo\nbackend: portable\n")


@pytest.mark.parametrize("text, got", [("- model\n- demo\n", "a list"), ("just text\n", "the scalar 'just text'")])
def test_top_level_must_be_a_mapping(text, got):
    with pytest.raises(ConfigError, match=f"must hold a mapping of option: value.*got {got}"):
        parse_config(text)


def test_config_error_is_an_etblocks_error():
    with pytest.raises(EtblocksError):
        parse_config("nope: 1\n")


def test_flags_override_file_and_file_overrides_defaults(tmp_path):
    config = load_config(write(tmp_path, "backend: portable\nmax_seq_len: 64\nout: a.pte\nverify: false\n"))
    options = resolve("export", {"backend": "xnnpack", "max_seq_len": None, "out": None, "verify": None}, config)
    assert options["backend"] == "xnnpack" and options.where("backend") == "--backend"
    assert options["max_seq_len"] == 64 and options.where("max_seq_len").endswith("line 2")
    assert options["out"] == "a.pte"
    assert options["verify"] is False
    assert options["sdpa"] is None  # not set anywhere: the recipe decides
    assert resolve("export", {"verify": True}, config)["verify"] is True
    defaults = resolve("export", {}, None)
    assert defaults["backend"] == OPTIONS["backend"].default == "xnnpack" and defaults.where("backend") == "default"
    assert defaults["verify"] is True and defaults["out"] == "model.pte"


def test_flag_values_are_checked_and_named():
    with pytest.raises(ConfigError, match=r"--max-seq-len: max_seq_len=1 \(int\) is not accepted"):
        resolve("export", {"max_seq_len": 1})
    with pytest.raises(ConfigError, match=r"--prompt-ids: prompt_ids='1,,2'"):
        resolve("run", {"prompt_ids": "1,,2"})
    with pytest.raises(ConfigError, match=r"--top-p: top_p=2.0"):
        resolve("run", {"top_p": 2.0})


def test_no_verify_flag_is_named_in_sources():
    assert resolve("export", {"verify": False}).where("verify") == "--no-verify"
    assert resolve("export", {"verify": True}).where("verify") == "--verify"


def test_run_options_and_pte_falls_back_to_out(tmp_path):
    config = load_config(write(tmp_path, "out: exported.pte\nprompt_ids: 1,2\n"))
    options = resolve("run", {"max_new_tokens": 5}, config)
    assert options["pte"] == "exported.pte"
    assert options["prompt_ids"] == [1, 2]
    assert options["max_new_tokens"] == 5 and options["temperature"] == 0.0 and options["top_p"] == 1.0
    assert options["seed"] is None
    assert "backend" not in options.values  # export-only options are not part of run
    assert resolve("run", {"pte": "flag.pte"}, config)["pte"] == "flag.pte"


def test_quantization_keys():
    config = parse_config("quantize_weights: 8da4w\ngroup_size: 64\nquantize_embedding: int8\nkv_quantize: int8\n")
    assert config.values == {"quantize_weights": "8da4w", "group_size": 64, "quantize_embedding": "int8", "kv_quantize": "int8"}
    options = resolve("export", {"quantize_weights": "8da8w"}, config)
    assert options["quantize_weights"] == "8da8w" and options.where("quantize_weights") == "--quantize-weights"
    assert options["quantize_activations"] == "auto" and resolve("export", {"quantize_activations": "none"})["quantize_activations"] is None
    assert options["group_size"] == 64 and options.where("group_size").endswith("line 2")
    assert resolve("export", {})["group_size"] == OPTIONS["group_size"].default == 32


def test_recipe_dtype_and_backend_options():
    import torch

    config = parse_config("dtype: float16\nqnn_chipset: SM8750\nattention: sha\n")
    assert config.values == {"dtype": torch.float16, "qnn_chipset": "SM8750", "attention": "sha"}
    assert resolve("export", {}, None)["qnn_chipset"] == "SM8650"  # the backend's declared default
