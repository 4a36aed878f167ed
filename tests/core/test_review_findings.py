"""Review findings on the redesign's merge (issue 38), core side: each failed on the merged tree, passes since."""

from __future__ import annotations

from vllm_lora_ext.errors import RECORD_MARK, AdapterCompatibilityError, error_from_text, with_record


def test_a_deeply_nested_record_in_a_name_does_not_break_reading_the_real_one() -> None:
    """``error_from_text`` tries every mark from the end; one inside the record (a client's adapter name) followed
    by deep brackets makes ``json`` raise RecursionError, which it does not catch: the worker's own record, further
    left, is never read, and the caller (``server._probe``) raises RecursionError instead of the worker's error."""
    name = "x" + RECORD_MARK + "[" * 2000
    err = AdapterCompatibilityError(f"Adapter {name!r} needs rank 32 but max_lora_rank is 16", adapter=name)
    back = error_from_text(f"Call to add_lora method failed: {with_record(err)}")
    assert type(back) is AdapterCompatibilityError and back.adapter == name


def test_an_os_error_of_another_module_stays_an_os_error_across_the_build_process() -> None:
    """The build process now sends records (`error_record`/`rebuild_error`) where it pickled the exception: an
    ``OSError`` subclass of another module (``filelock.Timeout`` from the disk tier's state lock, requests' and
    huggingface_hub's ``OSError`` subclasses) comes back as ``RemoteError`` (a ``RuntimeError``), so
    ``build_process.build_elsewhere``'s ``except OSError`` (build in the worker instead) no longer takes it and the
    load fails (500) where it used to be built in the worker."""
    import pickle

    import filelock

    from vllm_lora_ext.errors import error_record, rebuild_error

    err = filelock.Timeout("/cache/.locks/vllm_lora_ext/state.lock")
    assert isinstance(pickle.loads(pickle.dumps(err)), OSError)  # what crossed before
    assert isinstance(rebuild_error(error_record(err)), OSError)


def test_a_key_error_crosses_with_a_record_that_can_be_read_back() -> None:
    """``with_record`` keeps a ``KeyError``'s type (``KeyError(text)``), but ``str`` of a KeyError is the repr of
    its text: the record's JSON comes out with ``\\'`` escapes, ``error_from_text`` finds none, and the server
    passes the whole text, record included, into the client's 400 message."""
    from vllm_lora_ext.errors import with_record

    back = error_from_text(f"Call to add_lora method failed: {with_record(KeyError('model.layers.0.q_proj'))}")
    assert type(back) is KeyError
