"""Refuse a draft that does not fit its target, naming the mismatch."""

from __future__ import annotations

from dflash_robot.drafts.model import DFlashDraft
from dflash_robot.errors import IncompatibleDraftError
from dflash_robot.targets.base import TargetAdapter


def check_compatible(draft: DFlashDraft, target: TargetAdapter) -> None:
    """Raise IncompatibleDraftError listing every mismatch between draft and target."""
    meta, shape = draft.metadata, draft.shape
    problems = []
    if shape.hidden_size != target.hidden_size:
        problems.append(f"hidden size: draft {shape.hidden_size}, target {target.hidden_size} "
                        "(the draft reads the target's embeddings and feeds its lm_head)")
    expected_fc = len(meta.target_layer_ids) * target.hidden_size
    if shape.fc_in_features != expected_fc:
        problems.append(f"feature width: draft fc takes {shape.fc_in_features}, target gives "
                        f"{len(meta.target_layer_ids)} x {target.hidden_size} = {expected_fc}")
    if shape.vocab_size != target.vocab_size:
        problems.append(f"vocabulary: draft {shape.vocab_size}, target {target.vocab_size}")
    if not 0 <= meta.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {meta.mask_token_id} is outside the target vocabulary "
                        f"[0, {target.vocab_size})")
    bad_ids = [i for i in meta.target_layer_ids if not 0 <= i < target.num_layers]
    if bad_ids:
        problems.append(f"target_layer_ids {bad_ids} are beyond the target's depth "
                        f"({target.num_layers} layers, ids 0..{target.num_layers - 1})")
    if meta.num_target_layers != target.num_layers:
        problems.append(f"target depth: draft was built for {meta.num_target_layers} layers, "
                        f"target has {target.num_layers}")
    if draft.metadata.draft_vocab_size is not None and draft.t2d.shape[0] != target.vocab_size:
        problems.append(f"draft vocabulary map: t2d covers {draft.t2d.shape[0]} ids, target has {target.vocab_size}")
    # a draft on another device or in another dtype is fine: features are mirrored to it
    # (runtime/proposer.FeatureMirror)
    if problems:
        raise IncompatibleDraftError("draft does not fit the target:\n  - " + "\n  - ".join(problems))
