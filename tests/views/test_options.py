"""Mount options are declared once (ckptfs.views.options): the CLI flags, the server's argv, the Python API and the
content identity all derive from the declaration."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ckptfs.views import options as mo
from ckptfs.cli import build_parser
from ckptfs.fuse.mount import server_argv
from ckptfs.tree.assemble import content_identity

ROOT = Path(__file__).resolve().parent.parent.parent


def every_option_set(tmp_path) -> mo.MountOptions:
    """Options with every field away from its default."""
    cfg = tmp_path / "params.yaml"
    cfg.write_text("model: {}\n")
    return mo.MountOptions(config=cfg, model="llama", trainer_index=1, lora="keep", views=("cs", "hf"),
                           max_shard_size=123_000, tf_max_shard_size=24_000, tf_shard_by=2,
                           hf_format="bin", overlay=(tmp_path,),
                           zip_crc="zero", cache_size=64 << 20, allow_partial=True, allow_external=(tmp_path,),
                           data_iter_dir=tmp_path, shuffle_seed=7, single=True, added_tensors="omit",
                           allow_unused_weights=True, endpoint_url="http://127.0.0.1:9000", profile="ckpts",
                           revision="v2")


def test_the_sample_sets_every_declared_option(tmp_path):
    o = every_option_set(tmp_path)
    assert all(getattr(o, d.name) != d.default for d in mo.declared())


@pytest.mark.parametrize("command", ["mount", "export"])
def test_every_declared_option_is_a_flag_of_mount_and_export(command):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = {s for a in sub._actions for s in a.option_strings}
    for d in mo.declared():
        assert d.flag in flags, (command, d.name)
    help_text = sub.format_help()
    assert "(default: 5GB)" in help_text and "(default: 256MiB)" in help_text


def test_server_argv_gives_back_the_same_options(tmp_path):
    o = every_option_set(tmp_path)
    argv = server_argv(tmp_path / "c.mdl", tmp_path / "mnt", o, allow_other=True)
    args = build_parser().parse_args(argv)
    assert mo.from_args(args) == o
    assert args.foreground and args.allow_other
    defaults = server_argv("c.mdl", "mnt", mo.MountOptions())
    assert defaults[3:] == ["--foreground"]  # nothing to say for default options
    rel = server_argv("c.mdl", "mnt", mo.MountOptions(config=Path("p.yaml")))
    assert rel[rel.index("--config") + 1] == str(Path("p.yaml").absolute())  # the server runs in /


def test_the_api_parses_texts_like_the_command_line(tmp_path):
    o = mo.from_kwargs(max_shard_size="5MB", cache_size="1MiB", views="hf, cs", trainer_index="2",
                       config=str(tmp_path), allow_partial=True)
    assert (o.max_shard_size, o.cache_size, o.views, o.trainer_index) == (5 * 10**6, 1 << 20, ("hf", "cs"), 2)
    assert o.config == tmp_path and o.allow_partial is True
    assert mo.from_kwargs(max_shard_size=10) == mo.MountOptions(max_shard_size=10)
    with pytest.raises(TypeError, match="cache_sise"):
        mo.from_kwargs(cache_sise="1MB")
    with pytest.raises(ValueError, match="lots"):
        mo.from_kwargs(cache_size="lots")
    with pytest.raises(ValueError, match="bogus"):
        mo.from_kwargs(views="hf,bogus")


def test_content_identity_follows_the_content_flag(tmp_path):
    ck = tmp_path / "c.mdl"
    ck.write_bytes(b"x")
    sample = every_option_set(tmp_path)  # (its params file is one ck may be converted with: made first)
    base = content_identity(ck, mo.MountOptions())
    for d in mo.declared():
        one = mo.MountOptions(**{d.name: getattr(sample, d.name)})
        changed = content_identity(ck, one) != base
        assert changed == d.content, d.name
    cfg = sample.config
    before = content_identity(ck, mo.MountOptions(config=cfg))
    cfg.write_text("model: {hidden_size: 2}\n")  # an edited params file is other content
    assert content_identity(ck, mo.MountOptions(config=cfg)) != before


def test_a_repeatable_option_round_trips(tmp_path):
    """What a repeatable path option (the kind issue 16 adds) gets from the declaration alone."""
    from dataclasses import make_dataclass

    cls = make_dataclass("Opts", [("extra", tuple, mo.option((), "--extra", mo.PATH, repeat=True, help="x"))])
    decl = mo.Option("--extra", mo.PATH, "x", repeat=True, name="extra", default=())
    assert cls.__dataclass_fields__["extra"].metadata["option"].repeat
    assert decl.argv(()) == []
    assert decl.argv((Path("a"), Path("b"))) == ["--extra", str(Path("a").absolute()), "--extra",
                                                 str(Path("b").absolute())]
    assert decl.parse(["a", "b"]) == (Path("a"), Path("b")) and decl.parse("a") == (Path("a"),)


def test_cache_dir_is_resolved_in_one_place(tmp_path, monkeypatch):
    from ckptfs.layouts.torchzip.crc_store import default_crc_dir
    from ckptfs.fuse.mount import log_dir

    monkeypatch.setenv("CKPTFS_CACHE_DIR", str(tmp_path))
    assert (default_crc_dir(), log_dir()) == (tmp_path / "crc", tmp_path / "logs")
    monkeypatch.delenv("CKPTFS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_crc_dir() == tmp_path / "x" / "ckptfs" / "crc"


def test_the_environment_is_read_in_one_module_and_documented():
    """Only ckptfs/env.py reads environment variables (a copy handed to a child process is not a read), and the
    reference's table (docs/reference.md) lists every variable it names."""
    from ckptfs import env

    readers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "ckptfs").rglob("*.py")
               if re.search(r"os\.environ\s*[.\[]|os\.getenv|os\.environ\.get", p.read_text())]
    assert sorted(set(readers)) == ["ckptfs/env.py"]
    names = {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str)}
    table = (ROOT / "docs" / "reference.md").read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    assert names and {n for n in names if f"`{n}`" not in table} == set()


def test_flags_are_declared_only_in_the_options_module():
    """No other module of ckptfs spells a tree option's flag in an add_argument call."""
    flags = {d.flag for d in mo.declared()}
    for p in (ROOT / "ckptfs").rglob("*.py"):
        if p.name == "options.py":
            continue
        for flag in re.findall(r"add_argument\(\s*\"(--[a-z-]+)\"", p.read_text()):
            assert flag not in flags, (p, flag)
