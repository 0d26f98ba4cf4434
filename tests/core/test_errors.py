"""The error tree is part of the API: this test pins every class and its parents."""

from __future__ import annotations

import pytest

import millpond
from millpond import errors

# class -> its direct bases, in order. Changing the tree means changing this table on purpose.
EXPECTED_TREE: dict[str, tuple[type[BaseException], ...]] = {
    "MillpondError": (Exception,),
    "ConflictError": (errors.MillpondError,),
    "FencedError": (errors.MillpondError,),
    "FormatError": (errors.MillpondError,),
    "StorageError": (errors.MillpondError,),
    "CommitStateUnknownError": (errors.StorageError,),
    "NotFoundError": (errors.MillpondError, FileNotFoundError),
    "BackpressureError": (errors.MillpondError,),
    "ClosedError": (errors.MillpondError,),
    "InvalidInputError": (errors.MillpondError, ValueError),
    "ConfigError": (errors.MillpondError, ValueError),
    "StoreAccessError": (errors.MillpondError,),
    "BadBatchError": (errors.MillpondError,),
    "CorruptBatchError": (errors.FormatError, errors.BadBatchError),
    "BatchNotFoundError": (errors.NotFoundError, errors.BadBatchError),
    "SinkWaitError": (errors.MillpondError,),
    "SinkWaitTimeoutError": (errors.SinkWaitError, TimeoutError),
}


def test_every_error_class_and_its_parents() -> None:
    assert sorted(errors.__all__) == sorted(EXPECTED_TREE)
    for name, bases in EXPECTED_TREE.items():
        cls = getattr(errors, name)
        assert cls.__bases__ == bases, name
        assert cls.__name__.endswith("Error")


def test_every_error_is_exported_from_the_package() -> None:
    for name in EXPECTED_TREE:
        assert getattr(millpond, name) is getattr(errors, name)
        assert name in millpond.__all__


def test_not_found_is_a_file_not_found_error() -> None:
    err = errors.NotFoundError("ingest/manifest: not found")
    assert isinstance(err, FileNotFoundError)
    assert isinstance(err, OSError)
    assert isinstance(err, errors.MillpondError)
    with pytest.raises(FileNotFoundError) as info:
        raise err
    assert info.value is err


def test_commit_state_unknown_is_a_storage_error_not_a_conflict() -> None:
    err = errors.CommitStateUnknownError("x")
    assert isinstance(err, errors.StorageError)
    assert not isinstance(err, errors.ConflictError)


def test_errors_carry_their_details() -> None:
    fenced = errors.FencedError("fenced", expected_epoch=1, found_epoch=2)
    assert (fenced.expected_epoch, fenced.found_epoch) == (1, 2)
    fmt = errors.FormatError("bad", field="entry_len", offset=12)
    assert (fmt.field, fmt.offset) == ("entry_len", 12)
    config = errors.ConfigError("flush_interval", "expected > 0, found -1")
    assert config.key == "flush_interval"
    assert str(config) == "flush_interval: expected > 0, found -1"
    assert isinstance(config, ValueError)
    assert isinstance(errors.InvalidInputError("x"), ValueError)


def test_store_access_error_is_not_retried_as_a_storage_error() -> None:
    err = errors.StoreAccessError(
        "s3://b: bucket b does not exist", problem="bucket", hint="create it"
    )
    assert not isinstance(err, errors.StorageError)  # every retry loop catches StorageError
    assert not isinstance(err, errors.NotFoundError)  # "no manifest yet" would create one
    assert (err.problem, err.hint) == ("bucket", "create it")
    assert str(err) == "s3://b: bucket b does not exist; create it"


def test_a_sink_wait_timeout_is_a_timeout_error_and_says_how_far_behind() -> None:
    err = errors.SinkWaitTimeoutError("behind", reason="behind", waiting_for=12, written_through=9)
    assert isinstance(err, TimeoutError)
    assert isinstance(err, errors.SinkWaitError)
    assert (err.reason, err.behind, str(err)) == ("behind", 3, "behind")
    nothing = errors.SinkWaitTimeoutError("none", reason="no_consumer", waiting_for=0)
    assert nothing.behind == 1
    with pytest.raises(TimeoutError):
        raise nothing


def test_no_error_shadows_a_builtin() -> None:
    import builtins

    assert not set(EXPECTED_TREE) & set(dir(builtins))
