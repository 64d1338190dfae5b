"""The lazily parsed registry (``LazyRegistry``, what ``default_registry`` returns) answers every lookup exactly as
the eagerly parsed ``Registry``, parses only the families it is asked for, and raises a broken file's error as
``Registry`` does."""
from __future__ import annotations

import shutil

import pytest
import yaml

from ckptfs.errors import MappingError
from ckptfs.mapping.lang.families import LazyRegistry, Registry, default_registry, mapping_dirs


@pytest.fixture(scope="module")
def eager():
    return Registry()


def test_default_registry_is_lazy():
    assert isinstance(default_registry(), LazyRegistry)


def test_every_model_and_cs_name_finds_the_same_family(eager):
    lazy = LazyRegistry()
    for name, spec in eager.by_model.items():
        assert lazy.for_model(name) == spec, name
    cs_names = set(eager.by_cs_name) | set(eager.shared_cs_names) | set(eager.by_model)
    for name in sorted(cs_names) + ["no-such-model"]:
        assert lazy.for_cs_name(name) == eager.for_cs_name(name), name
        assert lazy.families_for_cs_name(name) == eager.families_for_cs_name(name), name
    for family, spec in eager.families.items():
        assert lazy.family(family) == spec
    assert lazy._full is None  # none of these needed every family
    with pytest.raises(MappingError, match="unknown model family 'nope'") as e_lazy:
        lazy.family("nope")
    with pytest.raises(MappingError) as e_eager:
        eager.family("nope")
    assert str(e_lazy.value) == str(e_eager.value)


def test_only_the_asked_family_is_parsed():
    lazy = LazyRegistry()
    spec = lazy.families_for_cs_name("llama")[0]
    assert spec.family == "llama" and list(lazy._specs) == ["llama"]
    assert lazy.for_cs_name("llama") is spec  # parsed once


def test_replacements_are_found_by_the_lazy_registry_as_by_the_full_one(eager):
    lazy = LazyRegistry()
    assert [s.family for s in lazy.families_replacing("bert")] == [s.family for s in eager.families_replacing("bert")]
    assert {s.family for s in eager.families_replacing("bert")} == {"bert", "roberta"}
    assert set(lazy._specs) == {"bert", "roberta"}  # only the families that declare a replacement of bert
    assert lazy.families_replacing("llama") == []


def test_what_needs_every_family_sees_them_all(eager):
    lazy = LazyRegistry()
    assert set(lazy.families) == set(eager.families)
    assert set(lazy.by_model) == set(eager.by_model)
    assert [m.name for m in lazy.models()] == [m.name for m in eager.models()]


def _copy_mappings(tmp_path):
    for f in mapping_dirs()[0].glob("*.yaml"):
        shutil.copy(f, tmp_path / f.name)


@pytest.mark.parametrize("change", ["clash", "bad_models", "shared_cs_name"])
def test_a_broken_file_raises_what_registry_raises(tmp_path, change):
    _copy_mappings(tmp_path)
    doc = yaml.safe_load((tmp_path / "llama.yaml").read_text())
    if change == "clash":  # a model name of another family
        doc["models"][0]["aliases"] = [*(doc["models"][0].get("aliases") or []), "gpt2"]
    elif change == "bad_models":
        doc["models"] = "llama"
    else:  # a CS name another family claims, without detect.config
        doc["cs_names"] = [*(doc.get("cs_names") or ["llama"]), "gpt2"]
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(MappingError) as e_eager:
        Registry([tmp_path])
    with pytest.raises(MappingError) as e_lazy:
        LazyRegistry([tmp_path])
    assert str(e_lazy.value) == str(e_eager.value)


def test_index_cache_parses_only_the_asked_family_and_its_fragments(tmp_path, eager):
    cache = tmp_path / "cache" / "mappings-index.json"
    first = LazyRegistry(index_cache=cache)
    assert cache.exists() and len(first._raw) == len(first._files)  # made by reading every file once
    lazy = LazyRegistry(index_cache=cache)
    assert lazy._raw == {}
    assert lazy.families_for_cs_name("llama") == eager.families_for_cs_name("llama")
    fragments = {k for k in lazy._files if "fragment" in yaml.safe_load(lazy._files[k].read_text())}
    assert set(lazy._raw) == {"llama.yaml"} | fragments
    for name, spec in eager.by_model.items():  # every lookup as Registry's, from the cached index
        assert lazy.for_model(name) == spec and lazy.for_cs_name(name) == eager.for_cs_name(name), name
    assert set(lazy.families) == set(eager.families)


@pytest.mark.parametrize("damage", ["changed_file", "corrupt_cache", "foreign_file_name"])
def test_a_stale_or_bad_index_cache_is_not_used(tmp_path, damage):
    _copy_mappings(tmp_path)
    cache = tmp_path / "idx.json"
    LazyRegistry([tmp_path], index_cache=cache)
    if damage == "changed_file":  # llama's names change: the cache made before must not be believed
        doc = yaml.safe_load((tmp_path / "llama.yaml").read_text())
        doc["models"][0]["aliases"] = [*(doc["models"][0].get("aliases") or []), "my-llama"]
        (tmp_path / "llama.yaml").write_text(yaml.safe_dump(doc))
    elif damage == "corrupt_cache":
        cache.write_text("{not json")
    else:  # a cache naming a file that is not in the folders: paths come from the listing only
        text = cache.read_text().replace('"llama.yaml"', '"../llama.yaml"')
        cache.write_text(text)
    lazy = LazyRegistry([tmp_path], index_cache=cache)
    assert len(lazy._raw) == len(lazy._files)  # read every file again
    assert lazy.for_model("llama").family == "llama"
    if damage == "changed_file":
        assert lazy.for_model("my-llama").family == "llama"
