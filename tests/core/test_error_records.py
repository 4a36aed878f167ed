"""Errors cross processes as records of their type and fields, and come back as the same type."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from vllm_lora_ext import errors
from vllm_lora_ext.errors import (
    AdapterCompatibilityError,
    AdapterNotFoundError,
    DiskCacheFullError,
    RemoteError,
    UnmatchedKeysError,
    error_from_text,
    error_record,
    rebuild_error,
    with_record,
)


class _Foreign(Exception):
    """A type only this process knows (a torch or vLLM error, to the other side)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code


@pytest.mark.parametrize("err", [
    UnmatchedKeysError("Adapter 'a' has 2 keys that match no module", adapter="a", keys=["k1", "k2"]),
    AdapterNotFoundError("no folder /srv/a", source="/srv/a", revision="main", public_message="no such adapter"),
    DiskCacheFullError("full", source="hf:acme/x", limit=10, in_use=8, needed=4),
    AdapterCompatibilityError("rank 32 > 16", adapter="big"),
])
def test_a_package_error_comes_back_as_its_type_with_its_fields(err: errors.VllmLoraExtError) -> None:
    record = error_record(err)
    json.dumps(record)  # plain data: any pipe, pickle or text carries it
    back = rebuild_error(pickle.loads(pickle.dumps(record)))
    assert type(back) is type(err) and str(back) == str(err) and vars(back) == vars(err)
    assert back.client_message() == err.client_message()


def test_builtin_errors_come_back_as_themselves() -> None:
    full = rebuild_error(error_record(OSError(28, "No space left on device", "/dev/shm/x")))
    assert type(full) is OSError and full.errno == 28 and full.filename == "/dev/shm/x"
    assert str(full) == "[Errno 28] No space left on device: '/dev/shm/x'"
    missing = rebuild_error(error_record(KeyError("w")))
    assert type(missing) is KeyError and missing.args == ("w",)


def test_an_unknown_type_becomes_a_remote_error_with_the_original_text() -> None:
    back = rebuild_error(error_record(_Foreign(7, "device lost")))
    assert type(back) is RemoteError and isinstance(back, RuntimeError)
    assert str(back) == "code 7: device lost" and back.type_name.endswith("_Foreign") and back.code == 7
    again = rebuild_error(error_record(back))  # a RemoteError crossing once more keeps the type it stands for
    assert type(again) is RemoteError and again.type_name == back.type_name and str(again) == str(back)


def test_the_record_crosses_inside_text_and_comes_back_typed() -> None:
    keys = [f"k{i}" for i in range(9000)]
    err = UnmatchedKeysError("Adapter 'a' has keys that match nothing", adapter="a", keys=keys)
    marked = with_record(err)
    assert type(marked) is UnmatchedKeysError and marked.keys == err.keys  # the same type where it was raised
    text = f"Call to add_lora method failed: {marked}"  # what vLLM hands the server
    back = error_from_text(text)
    assert type(back) is UnmatchedKeysError and str(back) == str(err) and back.adapter == "a"
    assert back.keys == err.keys[:4096]  # cut for the text channel
    assert error_from_text("Call to add_lora method failed: rank 32 > 16") is None
    assert error_from_text(f"Worker failed with error '{with_record(_Foreign(1, 'x'))}', see above").type_name \
        .endswith("_Foreign")


def test_a_record_crosses_a_real_pipe_from_another_interpreter() -> None:
    code = ("import pickle, sys\n"
            "from vllm_lora_ext.errors import AdapterCompatibilityError, error_record\n"
            "sys.stdout.buffer.write(pickle.dumps(error_record(AdapterCompatibilityError('rank 32 > 16', "
            "adapter='big'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, check=True)
    back = rebuild_error(pickle.loads(out.stdout))
    assert type(back) is AdapterCompatibilityError and back.adapter == "big" and str(back) == "rank 32 > 16"


def test_a_record_written_into_a_message_by_a_client_is_not_read_as_the_errors_type() -> None:
    fake = '{"type":"AdapterNotFoundError","message":"spoofed","args":["spoofed"],"fields":{"source":"x"}}'
    for name in (f"x{errors.RECORD_MARK}{fake}]", f"x{errors.RECORD_MARK}{{}}]"):
        err = AdapterCompatibilityError(f"Adapter {name!r} needs rank 32 but max_lora_rank is 16", adapter=name)
        back = error_from_text(f"Call to add_lora method failed: {with_record(err)}")
        assert type(back) is AdapterCompatibilityError and back.adapter == name and str(back) == str(err)
