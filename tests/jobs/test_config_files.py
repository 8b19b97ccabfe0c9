"""Config files are type-checked like the command line, and every error names the option
as the user wrote it: the key in the file, its flag, the value and the expected type;
checks of the config dataclass itself name flags, not field names."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from hybridrec.cli.options import ConfigError, option, parse_config
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.lm.config import LMConfig


def _toml(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return ["--config", str(path)]


# (TOML line, words the one-line error must contain: the key as written, its flag,
#  the value as written and what was expected)
BAD_TOML = [
    ('batch-size = "512"', ["'batch-size'", "--batch-size", '"512"', "an integer", "a string"]),
    ("batch-size = 512.0", ["'batch-size'", "--batch-size", "512.0", "an integer", "a float"]),
    ("batch_size = true", ["'batch_size'", "--batch-size", "true", "an integer", "a boolean"]),
    ('cache-fraction = "lots"', ["'cache-fraction'", "--cache-fraction", '"lots"', "a number"]),
    ("bottom-mlp = 32", ["'bottom-mlp'", "--bottom-mlp", "32", "a list of integers"]),
    ('bottom_mlp = [64, "x"]', ["'bottom_mlp'", "--bottom-mlp", "item 1", '"x"', "integers"]),
    ("top-mlp = [8.5]", ["'top-mlp'", "--top-mlp", "8.5", "a float"]),
    ('resume = "yes"', ["'resume'", "--resume", '"yes"', "true or false"]),
    ("verbose = 1", ["'verbose'", "--verbose", "1", "true or false"]),
    ('cache-policy = "fifo"', ["'cache-policy'", "--cache-policy", '"fifo"', '"lru", "lfu"']),
    ("data = 1", ["'data'", "--data", "one of", '"movielens"']),
    ("compression = 3", ["'compression'", "--compression", "3", "a string"]),
    ('criteo-path = "day_0.gz"', ["'criteo-path'", "--criteo-path", '"day_0.gz"', "a list"]),
    ("ps = [1]", ["'ps'", "--ps", "[1]", "a string", "a list"]),
    ("epochs = 2024-01-01", ["'epochs'", "--epochs", "2024-01-01", "an integer"]),
    ("[placement]\nx = 1", ["'placement'", "--placement", "a table"]),
]


@pytest.mark.parametrize(("line", "words"), BAD_TOML, ids=[b[0] for b in BAD_TOML])
def test_every_bad_toml_value_names_its_key_flag_value_and_type(
    tmp_path: Path, line: str, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(DLRMJobConfig, _toml(tmp_path, line + "\n"), "t")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"config file {tmp_path / 'run.toml'}: "), msg
    for word in words:
        assert word in msg, (word, msg)


def test_good_values_keep_their_types(tmp_path: Path) -> None:
    argv = _toml(
        tmp_path,
        'lr = 1\nbucket-mb = 4\nbatch-size = 64\nbottom-mlp = [32, 16]\ndata = "synthetic"\n'
        'resume = false\ncompression = "fp16"\nplacement-of = ["C1=sharded"]\n',
    )
    cfg = parse_config(DLRMJobConfig, argv, "t")
    # an int where a float is expected is a float, as "--lr 1" gives
    assert (cfg.lr, type(cfg.lr), cfg.bucket_mb, type(cfg.bucket_mb)) == (1.0, float, 4.0, float)
    assert (cfg.batch_size, cfg.bottom_mlp, cfg.data) == (64, [32, 16], "synthetic")
    assert (cfg.resume, cfg.compression, cfg.placement_of) == (False, "fp16", ["C1=sharded"])
    assert cfg == parse_config(
        DLRMJobConfig,
        shlex.split(
            "--lr 1 --bucket-mb 4 --batch-size 64 --bottom-mlp 32 16 --data synthetic "
            "--no-resume --compression fp16 --placement-of C1=sharded"
        ),
        "t",
    )


def test_json_null_is_none_only_where_the_option_may_be_none(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"compression": None, "checkpoint_dir": None}))
    cfg = parse_config(DLRMJobConfig, ["--config", str(path)], "t")
    assert (cfg.compression, cfg.checkpoint_dir) == (None, None)
    path.write_text(json.dumps({"batch-size": None}))
    with pytest.raises(ConfigError, match=r"'batch-size' \(--batch-size\): expected an integer"):
        parse_config(DLRMJobConfig, ["--config", str(path)], "t")
    path.write_text(json.dumps({"max_bytes": 1.5}))
    with pytest.raises(ConfigError, match=r"'max_bytes' \(--max-bytes\).*got 1.5 \(a float\)"):
        parse_config(LMConfig, ["--config", str(path)], "t")


def test_unknown_repeated_and_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown option 'batch-sise' \(did you mean 'batch-s"):
        parse_config(DLRMJobConfig, _toml(tmp_path, "batch-sise = 3\n"), "t")
    with pytest.raises(ConfigError, match="'batch-size' and 'batch_size' are the same option"):
        parse_config(DLRMJobConfig, _toml(tmp_path, "batch-size = 3\nbatch_size = 4\n"), "t")
    with pytest.raises(ConfigError, match=r"run.toml: not valid TOML: .*line 1"):
        parse_config(DLRMJobConfig, _toml(tmp_path, "batch-size = \n"), "t")
    bad_json = tmp_path / "run.json"
    bad_json.write_text('{"lr": 0.1,}')
    with pytest.raises(ConfigError, match=r"run.json: not valid JSON: .*line 1, column 12"):
        parse_config(DLRMJobConfig, ["--config", str(bad_json)], "t")
    bad_json.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a table of options, got a list"):
        parse_config(DLRMJobConfig, ["--config", str(bad_json)], "t")
    with pytest.raises(FileNotFoundError, match="config file .*nope.toml does not exist"):
        parse_config(DLRMJobConfig, ["--config", str(tmp_path / "nope.toml")], "t")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--batch-size 0", "--batch-size must be >= 1, got 0"),
        ("--resume", "--resume needs --checkpoint-dir (where to find the checkpoints)"),
        ("--compression fp16 --zero-stage 1", "(use --zero-stage 0)"),
        ("--data criteo", "--data 'criteo' needs --criteo-path FILE [FILE ...]"),
        ("--cache-rows 3 --cache-fraction 0.5", "give --cache-rows or --cache-fraction, not both"),
        ("--placement-of user", "--placement-of: expected TABLE=local|hybrid|sharded, got 'user'"),
        ("--ps etcd://x", "--ps 'etcd://x': expected 'local'"),
    ],
)
def test_dataclass_checks_name_flags_not_fields(argv: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_config(DLRMJobConfig, argv.split(), "t")
    msg = str(info.value)
    assert message in msg, msg
    assert not [f for f in DLRMJobConfig.__dataclass_fields__ if "_" in f and f in msg], msg


def test_lm_checks_and_file_values_name_flags_too(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a cache needs --placement 'hybrid' for the token or"):
        parse_config(LMConfig, ["--cache-rows", "5", "--placement", "sharded"], "t")
    with pytest.raises(ValueError, match="^--max-steps must be >= 1, got 0$"):
        parse_config(LMConfig, _toml(tmp_path, "max_steps = 0\n"), "t")


def test_old_option_names_still_work_and_say_the_new_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The LM job's ``--steps`` is ``--max-steps`` as in the DLRM job: the old spelling
    works for one more release, on the command line and in a config file, with a note."""
    assert parse_config(LMConfig, ["--steps", "7"], "t").max_steps == 7
    err = capsys.readouterr().err
    assert err == (
        "hybridrec: note: --steps is now --max-steps; the old name still works in this "
        "release and will be removed in the next\n"
    ), err
    assert parse_config(LMConfig, _toml(tmp_path, "steps = 9\n"), "t").max_steps == 9
    assert "'steps' is now 'max_steps'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'steps' and 'max_steps' are the same option"):
        parse_config(LMConfig, _toml(tmp_path, "steps = 9\nmax_steps = 3\n"), "t")
    capsys.readouterr()
    assert parse_config(LMConfig, ["--max-steps", "4"], "t").max_steps == 4
    assert capsys.readouterr().err == ""


def test_values_and_words_that_look_like_fields_stay(tmp_path: Path) -> None:
    @dataclass(kw_only=True, slots=True)
    class Cfg:
        data: str = option("x", help="a name")
        data_dir: str = option("d", help="a directory")

        def __post_init__(self) -> None:
            if self.data == "data":
                raise ValueError(f"data must not be {self.data!r}; see --data-dir, metadata")

    with pytest.raises(ValueError) as info:
        parse_config(Cfg, ["--data", "data"], "t")
    assert str(info.value) == "--data must not be 'data'; see --data-dir, metadata"


def test_command_line_errors_are_one_line_config_errors() -> None:
    cases = [
        ("--batch-size x", "--batch-size: invalid int value: 'x'"),
        ("--cache-policy fifo", "--cache-policy: invalid choice: 'fifo'"),
        ("--bottom-mlp", "--bottom-mlp: expected at least one argument"),
        ("--max-step 3 --bogus", "unrecognized arguments: --bogus"),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError) as info:
            parse_config(DLRMJobConfig, argv.split(), "t")
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
        assert "--help lists the options" in str(info.value)


def test_required_options_are_named() -> None:
    @dataclass(kw_only=True, slots=True)
    class Cfg:
        path: str = option(help="input file")
        mode: Literal["a", "b"] = option("a", help="mode")

    with pytest.raises(ConfigError, match=r"^--path is required \(or 'path' in a --config file\)$"):
        parse_config(Cfg, [], "t")
    assert parse_config(Cfg, ["--path", "p"], "t") == Cfg(path="p")
