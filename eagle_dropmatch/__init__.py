"""EAGLE-3 tree speculative decoding with DropMatch on stock Hugging Face transformers."""

from .dropmatch import DropMatchConfig
from .generate import DecodeConfig, Generation, SpeculativeDecoder
from .loading import EagleModel, LoadError, load

__all__ = ["DecodeConfig", "DropMatchConfig", "EagleModel", "Generation", "LoadError", "SpeculativeDecoder",
           "load"]
__version__ = "0.1.0"
