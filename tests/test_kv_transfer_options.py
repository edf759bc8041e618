"""A node's ``--kv-transfer-config``: JSON by transport into each transport's options, every field
checked (name, type, range), refused at start with one line before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve import kv_transfer
from pdserve.kv_transfer import NcclOptions, NixlOptions, StagingOptions, ZmqOptions


def test_fields_named_are_set_and_the_rest_keep_their_defaults():
    config = {
        "nixl": {"ucx_net_devices": "mlx5_0:1", "settle_spin_s": 0, "staging": {"num_slots": 2}},
        "zmq": {"max_frame_bytes": 4 << 20},
        "nccl": {"connect_s": 5},
    }
    nixl, zmq, nccl = kv_transfer.options_from_config(json.dumps(config))
    assert nixl == NixlOptions(
        ucx_net_devices="mlx5_0:1", settle_spin_s=0.0, staging=StagingOptions(num_slots=2)
    )
    assert isinstance(nixl.settle_spin_s, float) and isinstance(nccl.connect_s, float)  # ints taken as floats
    assert zmq == ZmqOptions(max_frame_bytes=4 << 20)
    assert nccl == NcclOptions(connect_s=5.0)
    assert kv_transfer.options_from_config("") == kv_transfer.options_from_config("  ") == ()
    assert kv_transfer.options_from_config("{}") == ()


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ("{nixl", "is not JSON"),
        ("[1]", "must be a JSON object by transport"),
        ('{"rdma": {}}', r"names 'rdma': options are given for nixl, nccl, zmq"),
        ('{"sim": {"gbps": 1}}', "a simulated engine sets the sim transport's"),
        ('{"nixl": 3}', "nixl must be a JSON object of NixlOptions's fields"),
        ('{"nixl": {"max_read": 1}}', r"nixl: unknown option 'max_read' \(NixlOptions has .*max_read_s"),
        ('{"nixl": {"staging": {"slots": 2}}}', r"nixl.staging: unknown option 'slots'"),
        ('{"nccl": {"recv_timeout_s": "3"}}', "nccl.recv_timeout_s must be float, got '3'"),
        ('{"zmq": {"staging_buffers": true}}', "zmq.staging_buffers must be int, got True"),
        ('{"zmq": {"staging_buffers": 2.5}}', "zmq.staging_buffers must be int, got 2.5"),
        ('{"nixl": {"progress_thread": 1}}', "nixl.progress_thread must be bool, got 1"),
        ('{"nixl": {"ucx_tls": 7}}', "nixl.ucx_tls must be str, got 7"),
        (
            '{"nixl": {"staging": {"num_slots": 0}}}',
            r"nixl.staging: StagingOptions.num_slots must be > 0, got 0",
        ),
        ('{"nixl": {"settle_spin_s": -1}}', r"NixlOptions.settle_spin_s must be >= 0, got -1.0"),
        ('{"nixl": {"max_read_s": NaN}}', r"NixlOptions.max_read_s must be > 0, got nan"),
        ('{"zmq": {"max_frame_bytes": 0}}', r"ZmqOptions.max_frame_bytes must be > 0"),
        ('{"nccl": {"direct_min_run_bytes": -4}}', r"NcclOptions.direct_min_run_bytes must be >= 0"),
    ],
)
def test_what_a_transport_cannot_take_is_refused_by_name(config, error):
    with pytest.raises(ValueError, match=error):
        kv_transfer.options_from_config(config)


def test_options_objects_check_their_ranges_when_built_in_code_too():
    with pytest.raises(ValueError, match="StagingOptions.slot_bytes must be > 0"):
        StagingOptions(slot_bytes=0)
    with pytest.raises(ValueError, match="NixlOptions.layer_chunk_bytes must be > 0"):
        NixlOptions(layer_chunk_bytes=0)
    with pytest.raises(ValueError, match="SimOptions.gbps must be >= 0"):
        kv_transfer.SimOptions(gbps=-1.0)
    assert NixlOptions(descriptors_per_piece=0, settle_spin_s=0.0).descriptors_per_piece == 0  # 0s mean "off"


def test_the_options_reach_the_planes_of_both_sides():
    (zmq,) = kv_transfer.options_from_config('{"zmq": {"staging_buffers": 1}}')
    sender = kv_transfer.create_sender("zmq", options=[zmq])
    receiver = kv_transfer.create_receiver("zmq", options=[zmq])
    try:
        assert sender.planes["zmq"].options.staging_buffers == 1
        assert receiver.planes["zmq"].options == zmq
    finally:
        sender.close()
        receiver.close()


def test_a_node_refuses_a_bad_config_before_it_loads_its_model(tmp_path):
    cmd = [sys.executable, "-m", "pdserve", "node", "--role", "decode", "--model", str(tmp_path / "absent")]
    bad = subprocess.run(
        [*cmd, "--kv-transfer-config", '{"nixl": {"staging": {"num_slots": 0}}}'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        "pdserve node: --kv-transfer-config nixl.staging: StagingOptions.num_slots must be > 0, got 0"
    )
    assert "Traceback" not in bad.stderr
