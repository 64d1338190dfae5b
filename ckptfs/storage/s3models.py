"""botocore's data loader (the JSON models of S3, its endpoint rules, the partitions), made lighter for a command's
start: the same files from the same search paths (``AWS_DATA_PATH`` included), with two costs of botocore's own
loader left out (docs/measurements.md, "An S3 command's start"):

* whether a service has a model is looked up in that service's folder, where botocore lists the folders of all ~400
  services (once per model type: twice for an S3 client);
* the JSON is decoded into plain dicts (ordered, as every dict is), where botocore builds an ``OrderedDict`` of every
  object of ~3.6 MB of JSON (S3's model, its endpoint rules, ``endpoints.json``): about twice the decoding time.

Only models and their metadata are read here: nothing is written, nothing about credentials passes. Imported by
``s3client`` when it makes a client (botocore is imported with it).
"""
from __future__ import annotations

import gzip
import json
import os
from collections.abc import Sequence

from botocore.exceptions import DataNotFoundError
from botocore.loaders import JSONFileLoader, Loader


class PlainJSONFileLoader(JSONFileLoader):
    """botocore's JSON file loader, decoding into plain dicts."""

    def load_file(self, file_path):
        for ext, opener in ((".json", open), (".json.gz", gzip.open)):  # botocore's order
            full_path = file_path + ext
            if os.path.isfile(full_path):
                with opener(full_path, "rb") as f:
                    return json.loads(f.read().decode("utf-8"))
        return None


class ServiceNames(Sequence):
    """The services with a ``type_name`` model: ``in`` looks in that service's folder only; the whole list is made
    when it is read (botocore reads it to name the known services when one is not)."""

    def __init__(self, loader: Loader, type_name: str):
        self._loader, self._type_name, self._all = loader, type_name, None

    def __contains__(self, name) -> bool:
        try:
            return bool(self._loader.list_api_versions(name, self._type_name))
        except DataNotFoundError:
            return False

    def _listed(self) -> list:
        if self._all is None:
            self._all = Loader.list_available_services(self._loader, self._type_name)
        return self._all

    def __getitem__(self, i):
        return self._listed()[i]

    def __len__(self) -> int:
        return len(self._listed())


class ModelLoader(Loader):
    """botocore's loader with ``PlainJSONFileLoader`` and ``ServiceNames`` (see the module docstring)."""

    FILE_LOADER_CLASS = PlainJSONFileLoader

    def list_available_services(self, type_name):
        return ServiceNames(self, type_name)


def use_model_loader(session) -> None:
    """Make ``session`` (a botocore session) load its models with a ``ModelLoader`` searching where botocore's own
    loader would (its search paths: ``AWS_DATA_PATH``, then botocore's)."""
    default = session.get_component("data_loader")  # made, not used: nothing is read until a model is loaded
    session.register_component("data_loader", ModelLoader(extra_search_paths=list(default.search_paths),
                                                          include_default_search_paths=False))
