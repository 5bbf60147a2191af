"""The block-diffusion draft: its model (`model`), metadata schema (`metadata`), z-lab's
checkpoint format (`checkpoint`), and the check that a draft fits its target (`validation`).
The draft shipped for the default target lives in `smollm2-135m-instruct/`."""

from dflash_robot.drafts.checkpoint import SHIPPED_DRAFT, load_draft, save_draft
from dflash_robot.drafts.metadata import DraftMetadata, build_target_layer_ids
from dflash_robot.drafts.model import DFlashDraft, build_draft

__all__ = ["SHIPPED_DRAFT", "DFlashDraft", "DraftMetadata", "build_draft", "build_target_layer_ids", "load_draft",
           "save_draft"]
