"""Human-friendly byte sizes for flags like --max-shard-size 5GB and for log lines."""
import argparse
import re

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '200KiB' -> 204800, '1024' -> 1024 (transformers' convention: GB is 1e9).

    An argparse type: a bad value is reported by the parser, in one line naming the flag."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}: give bytes, or a number with KB, MB, GB, TB "
                                         f"(powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. 5GB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def positive_size(text: str) -> int:
    """parse_size, of 1 byte or more: an argparse type for a bound such as --max_shard_size, where 0 would say
    nothing the smallest size does not (each tensor in a file of its own) and is more likely a slip."""
    size = parse_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"cannot use size {text!r}: give 1 byte or more (e.g. 5GB)")
    return size


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1."""
    if not str(text).strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: give a whole number of at least 1")
    return int(text)


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
