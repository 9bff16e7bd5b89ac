"""Supervised fine-tuning on instruction and chat examples: formats, chat templates, response masks, packing.

Plain functions a user can call without Lightning (:mod:`formats`, :mod:`templates`, :mod:`masking`,
:mod:`packing`, :mod:`loading`) and a thin DataModule over them (:class:`SFTDataModule`, ``data=sft``).
"""
from lit_speed.sft.formats import detect_format, to_conversation
from lit_speed.sft.masking import render_spans, tokenize_spans
from lit_speed.sft.packing import collate_packed, collate_padded, grouped_batches, pack_best_fit
from lit_speed.sft.response_samples import ResponseSamples
from lit_speed.sft.sft_data_module import SFTDataModule
from lit_speed.sft.templates import NAMED, resolve_template

__all__ = ["NAMED", "ResponseSamples", "SFTDataModule", "collate_packed", "collate_padded", "detect_format",
           "grouped_batches", "pack_best_fit", "render_spans", "resolve_template", "to_conversation", "tokenize_spans"]
