"""Evaluation through lm-evaluation-harness: the model adapter (adapter.py), the tasks and their checks
(harness.py), the shipped task YAMLs (tasks/). lm_eval is imported only here, never by `import titan_npu`."""
