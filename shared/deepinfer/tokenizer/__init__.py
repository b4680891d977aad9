"""Torch-free tokenization: encode/decode, chat templates, streaming detokenization and stop strings."""

from deepinfer.tokenizer.chat_template import ChatTemplateError
from deepinfer.tokenizer.detokenizer import IncrementalDetokenizer
from deepinfer.tokenizer.stop import StopChecker
from deepinfer.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "StopChecker", "Tokenizer"]
