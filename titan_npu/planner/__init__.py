"""The planner: per-rank memory and step time of a layout before launch (`titan-npu plan`), and the dry run that
builds one rank of the job for real and checks the planner's exact numbers (`train.py --dry-run`)."""
