"""slide-io: tensor stores with asynchronous futures (pinned host tier, NVMe tier, NVMe striped over drives) and
disk preflight."""

from slide_io.__about__ import __version__
from slide_io.disk import free_bytes, preflight
from slide_io.drives import Drives, Folders, folders_of
from slide_io.errors import StoreCorruptError, StoreFullError, is_disk_full
from slide_io.host import HostStore
from slide_io.kvikio_path import (
    MARGIN,
    PATH_ENV,
    PATHS,
    PathChoice,
    PathRates,
    choose_path,
    kvikio_choice,
    prefer_path,
    select_path,
)
from slide_io.nvme import NVMeStore
from slide_io.store import TensorStore

__all__ = [
    "MARGIN",
    "PATHS",
    "PATH_ENV",
    "Drives",
    "Folders",
    "HostStore",
    "NVMeStore",
    "PathChoice",
    "PathRates",
    "StoreCorruptError",
    "StoreFullError",
    "TensorStore",
    "__version__",
    "choose_path",
    "folders_of",
    "free_bytes",
    "is_disk_full",
    "kvikio_choice",
    "prefer_path",
    "preflight",
    "select_path",
]
