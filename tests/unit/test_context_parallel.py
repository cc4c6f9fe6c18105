"""The context-parallel split and its inverse (`rl_megatron.models.context_parallel`).

The split must be megatron-core's own: its RoPE (`get_pos_emb_on_this_cp_rank`,
`_get_thd_freqs_on_this_cp_rank`) rotates each local token by the position these chunks
imply, so the positions are checked against megatron-core's batch split and its THD RoPE
slicing, and the gather order against a plain concatenation of every rank's split.
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.models import context_parallel as cpo


def test_split_order_is_chunks_r_and_2cp_minus_1_minus_r():
    # cp = 2, s = 8: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cpo.local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpo.local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # cp = 4, s = 8: chunks of 1.
    assert [cpo.local_positions(8, 4, r).tolist() for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]
    assert cpo.chunk_starts(12, 3, 1) == (2, 8)
    x = torch.arange(2 * 8).view(2, 8) + 100
    assert cpo.split_for_cp(x, 2, 1).tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert cpo.split_for_cp(x, 1, 0) is x


def test_split_refuses_a_length_not_divisible_by_2cp():
    with pytest.raises(ValueError, match="not a multiple of 2·cp = 4"):
        cpo.local_positions(6, 2, 0)


class _Group:
    """What megatron-core's split asks of a CP group."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp", [2, 3])
def test_split_equals_megatron_cores_batch_split(monkeypatch, cp):
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    s = 4 * cp
    batch = torch.randn(3, s, 5)
    for rank in range(cp):
        theirs = get_batch_on_this_cp_rank({"tokens": batch.clone()}, _Group(cp, rank))
        assert torch.equal(cpo.split_for_cp(batch, cp, rank), theirs["tokens"])


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_split_matches_megatron_cores_thd_rope_slices(cp):
    """Each packed sequence is cut like one sequence; megatron-core's THD RoPE slices the
    same positions out of a per-sequence table."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    lengths = [4 * cp, 2 * cp, 0, 6 * cp]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    freqs = torch.arange(max(lengths)).view(-1, 1, 1, 1).float()  # a row per position
    packed = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)  # in-sequence index
    for rank in range(cp):
        local = cpo.split_packed_for_cp(packed, cu, cp, rank)
        theirs = [
            _get_thd_freqs_on_this_cp_rank(rank, cp, torch.empty(n // cp), freqs).view(-1)
            for n in lengths
            if n
        ]
        assert local.view(-1).tolist() == torch.cat(theirs).long().tolist()
        # The packed index of each local token.
        positions = cpo.packed_local_positions(cu, cp, rank)
        starts = torch.repeat_interleave(cu[:-1], torch.tensor(lengths) // cp)
        assert torch.equal(positions - starts, local.view(-1))


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_gathered_order_inverts_the_split(cp):
    s = 6 * cp
    x = torch.randn(2, s, 3)
    gathered = torch.cat([cpo.split_for_cp(x, cp, r) for r in range(cp)], dim=1)
    order = cpo.gathered_order(s, cp)
    assert torch.equal(gathered.index_select(1, order), x)


def test_gathered_order_inverts_the_packed_split():
    cp, cu = 2, [0, 8, 12, 12, 24]
    x = torch.randn(1, 24, 3)
    gathered = torch.cat([cpo.split_packed_for_cp(x, cu, cp, r) for r in range(cp)], dim=1)
    assert torch.equal(gathered.index_select(1, cpo.gathered_order(24, cp, cu)), x)


def test_packed_split_checks_the_pack_length():
    with pytest.raises(ValueError, match="cu_seqlens end at 8"):
        cpo.split_packed_for_cp(torch.zeros(1, 12), [0, 8], 2, 0)


def test_pack_pads_each_sequence_for_cp():
    """`seq_multiple` pads every row's sequence at its end; outputs are read at the same
    tokens as without it."""
    from rl_megatron.trainer.packing import pack_micro_batch

    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    responses = torch.tensor([[1, 2, 0], [3, 0, 0]])
    mask = torch.cat([prompts != 0, responses != 0], dim=1).long()
    batch = {"prompts": prompts, "responses": responses, "attention_mask": mask}
    plain = pack_micro_batch(dict(batch))
    padded = pack_micro_batch(dict(batch), seq_multiple=4, multiple_of=4)
    assert padded["cu_seqlens"].tolist() == [0, 4, 8]
    assert padded["packed_ids"].tolist() == [[5, 6, 1, 2, 7, 8, 9, 3]]
    assert plain["cu_seqlens"].tolist() == [0, 4, 8]  # already multiples of 4
    odd = pack_micro_batch(
        {
            "prompts": torch.tensor([[0, 5, 6], [0, 8, 9]]),
            "responses": torch.tensor([[1, 0, 0], [3, 0, 0]]),
            "attention_mask": torch.tensor([[0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]]),
        },
        seq_multiple=4,
        multiple_of=8,
    )
    assert odd["cu_seqlens"].tolist() == [0, 4, 8]
    assert odd["packed_ids"].tolist() == [[5, 6, 1, 0, 8, 9, 3, 0]]
    assert odd["packed_position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    # Row i's response token k is predicted at its packed position gather_index[i, k].
    ids = odd["packed_ids"][0]
    assert ids[odd["gather_index"][:, 0] + 1].tolist() == [1, 3]
