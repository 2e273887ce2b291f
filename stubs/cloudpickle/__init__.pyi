# Types for the parts of cloudpickle that taas-magic uses: cloudpickle ships none of its own.
import pickle
from typing import IO, Any, Callable

class Pickler(pickle.Pickler):
    def __init__(self, file: IO[bytes], protocol: int | None = None,
                 buffer_callback: Callable[[pickle.PickleBuffer], Any] | None = None) -> None: ...
    def dump(self, obj: Any) -> None: ...
    def reducer_override(self, obj: Any) -> Any: ...

def dumps(obj: Any, protocol: int | None = None,
          buffer_callback: Callable[[pickle.PickleBuffer], Any] | None = None) -> bytes: ...

loads = pickle.loads
load = pickle.load
