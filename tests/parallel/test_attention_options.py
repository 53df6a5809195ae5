"""AttentionOptions (parallel/options.py): one frozen object, validated once, mapped from the plugin in one place."""

from __future__ import annotations

import dataclasses

import pytest

from specforge_csbp.distributed.collectives import COMM_STATS, CommStats
from specforge_csbp.parallel import AttentionOptions


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"backend": "triton"}, "^backend must be one of auto, dense, flex; got 'triton'$"),
        ({"schedule": "ring"}, "^schedule must be one of fused, overlap; got 'ring'$"),
        ({"schedule": "fused", "regather": True}, "^regather needs schedule 'overlap'"),
        ({"regather": "yes"}, "^regather must be one of True, False; got 'yes'$"),
        ({"gather_ahead": 1}, "^gather_ahead must be one of True, False; got 1$"),
        ({"pack_gqa": "auto"}, "^pack_gqa must be one of None, True, False; got 'auto'$"),
        ({"stats": {}}, "^stats must be a CommStats; got dict$"),
    ],
)
def test_bad_options_are_one_line_errors_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        AttentionOptions(**changes)


def test_defaults_schedule_resolution_and_equality_ignoring_the_byte_counter():
    default = AttentionOptions()
    assert (default.backend, default.schedule, default.regather, default.pack_gqa, default.gather_ahead) == (
        "auto", None, False, None, True
    )
    assert default.stats is COMM_STATS and default.resolved_schedule == "fused"
    assert AttentionOptions(regather=True).resolved_schedule == "overlap"
    assert AttentionOptions(stats=CommStats()) == default  # prepared steps match whatever counts the bytes
    assert AttentionOptions(pack_gqa=True) != default
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.backend = "dense"
    with pytest.raises(ValueError, match="^regather needs schedule 'overlap'"):
        AttentionOptions(schedule="fused").replace(regather=True)  # a copy is validated again


def test_plugin_options_map_onto_one_attention_options():
    from specforge_csbp.plugin.options import CSBPOptions, attention_options

    options = CSBPOptions(regather=True, gather_ahead=False, pack_gqa=True)
    assert attention_options(options, "flex_attention") == AttentionOptions(
        backend="flex", schedule=None, regather=True, pack_gqa=True, gather_ahead=False
    )
    assert attention_options(CSBPOptions(), "eager") == AttentionOptions(backend="dense")
    assert attention_options(CSBPOptions(attention_schedule="overlap"), "sdpa").resolved_schedule == "overlap"
