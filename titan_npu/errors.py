"""User-facing errors: each one is printed as a single line by the command line, never a traceback."""


class TitanError(Exception):
    """Base of every error that is the user's to fix; its message names the problem and the fix."""


class ConfigError(TitanError):
    """A config file, key, value or CLI override is wrong."""


class DataError(TitanError):
    """A corpus, shard, tokenizer or loader state is unusable."""


class CheckpointError(TitanError):
    """A checkpoint is missing, incomplete or does not fit the model."""


class LayoutError(ConfigError):
    """A parallel layout does not fit the world size or the model."""


class DeviceError(TitanError):
    """The device, its software stack or the process group cannot be set up."""
