"""Integer helpers for the host side of the kernel launches. ``triton.cdiv`` and
``triton.next_power_of_2`` are constexpr functions in Triton 3.4+ (usable inside
kernels), and calling one from Python unwraps its arguments: about 2 us a call
here, 7 on the H200 host, several times per layer call in eager use."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (b > 0)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
