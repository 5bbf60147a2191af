import pytest

from dflash_robot.drafts.metadata import DraftMetadata, build_target_layer_ids, default_loss_decay


@pytest.mark.parametrize("L,n,expected", [
    (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B drafts
    (30, 1, [15]),
    (30, 2, [1, 27]),
    (6, 2, [1, 3]),
    (30, 3, [1, 14, 27]),
    (12, 4, [1, 4, 6, 9]),  # 1 + i*8/3: 3.67->4, 6.33->6, 9
    (10, 5, [1, 2, 4, 6, 7]),  # 1 + i*6/4: 2.5 -> 2 (half to even), 5.5 -> 6 (half to even)
])
def test_layer_id_formula(L, n, expected):
    assert build_target_layer_ids(L, n) == expected


def test_loss_decay_paper_values():
    assert (default_loss_decay(16), default_loss_decay(10), default_loss_decay(8)) == (7.0, 5.0, 4.0)


def test_metadata_roundtrip():
    m = DraftMetadata(block_size=16, mask_token_id=5, target_layer_ids=(1, 9), num_target_layers=12,
                      num_draft_layers=2, training_block_size=16, loss_decay=7.0)
    entries = m.to_config_entries()
    assert entries["dflash_config"]["mask_token_id"] == 5 and entries["num_target_layers"] == 12
    assert DraftMetadata.from_config_dict({**entries, "num_hidden_layers": 2}) == m


def test_zlab_style_config_without_our_fields():
    cfg = {"num_hidden_layers": 1, "block_size": 10, "num_target_layers": 30,
           "dflash_config": {"mask_token_id": 7}}
    m = DraftMetadata.from_config_dict(cfg)
    assert m.target_layer_ids == (15,) and m.training_block_size == 10 and m.loss_decay == 5.0
