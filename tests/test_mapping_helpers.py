"""Old name of tests/mappinghelp.py, kept only so that tests written against it still import; import
``mappinghelp`` instead."""
from mappinghelp import FIXTURES, RecordingTensor, checkpoint_from_model, model_tensors, open_fixture, open_path  # noqa: F401
