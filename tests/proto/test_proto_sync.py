"""The generated code in proto/ is what protoc makes of proto/pdserve.proto today."""
from __future__ import annotations

import subprocess
import sys


def test_generated_code_is_in_sync_with_the_proto() -> None:
    out = subprocess.run([sys.executable, "-m", "pdserve.proto.generate", "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_sampling_params_round_trip_and_validation() -> None:
    import pytest

    from pdserve.engine.core.sampling_params import InvalidRequestError, SamplingParams
    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto.convert import params_from_proto, params_to_proto

    p = SamplingParams(n=2, max_tokens=7, temperature=0.9, top_p=0.8, top_k=5, seed=3,
                       stop=("x",), logprobs=2, transfer_failure_policy="recompute")
    assert params_from_proto(params_to_proto(p)) == p
    text = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    assert params_from_proto(params_to_proto(text)) == text  # the output text's options
    with pytest.raises(InvalidRequestError) as e:
        params_from_proto(pb.SamplingParams(top_p=1.5))
    assert e.value.param == "top_p"
