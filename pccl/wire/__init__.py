"""Wire protocol: sans-I/O framing, control messages, data-frame headers, stream adapter."""

from .._config import PROTOCOL_VERSION
from .framing import Framer, encode_frame
from .messages import Message, decode, encode

__all__ = ["PROTOCOL_VERSION", "Framer", "Message", "decode", "encode", "encode_frame"]
