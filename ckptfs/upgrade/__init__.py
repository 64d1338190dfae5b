"""Release upgrades of Cerebras checkpoints and params YAML, from the source release to 2.10 in one pass.

Rules are data: one table entry per release hop (``state_rules.STATE_HOPS``,
``params_rules.PARAMS_HOPS``), applied in sequence by ``upgrade_checkpoint``; they come from Model Zoo's CS→CS
converters and its ``fix_checkpoint_spec.py`` (``state_rules.py`` says which rule comes from where).
"""
from .checkpoint import UpgradeResult, upgrade_checkpoint
from .params_rules import ParamsEdit, upgrade_params
from .releases import CURRENT, CURRENT_VERSION, hops
from .state_rules import StateEdit, upgrade_state

__all__ = ["UpgradeResult", "upgrade_checkpoint", "ParamsEdit", "upgrade_params", "StateEdit", "upgrade_state",
           "hops", "CURRENT", "CURRENT_VERSION"]
