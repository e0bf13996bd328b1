"""Implementations: models (``model``), datasets (``dataset``) and rollout workflows (``workflow``)."""
