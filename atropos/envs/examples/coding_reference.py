"""Reference solutions of the coding tasks, as scripted policies: what proves the verifier can
say yes (the reference scores 1) while the starting stub scores 0."""

from __future__ import annotations

from typing import Any

from atropos.testing import by_turn, tool_call

__all__ = ["SOLUTIONS", "reference_policy"]

SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b\n",
    "is_palindrome": "def is_palindrome(s):\n    return s.lower() == s.lower()[::-1]\n",
    "fizzbuzz": ("def fizzbuzz(n):\n    return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 else "
                 "'Buzz' if n % 5 == 0 else str(n)\n"),
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
    "reverse_words": "def reverse_words(s):\n    return ' '.join(s.split(' ')[::-1])\n",
    "max_of": "def max_of(xs):\n    return max(xs)\n",
}


def reference_policy(name: str) -> Any:
    """Write the reference solution of task ``name``, run the visible test, answer."""
    return by_turn(tool_call("write_file", path="/workspace/solution.py", content=SOLUTIONS[name]),
                   tool_call("bash", command="python3 test_visible.py"), "Done: implemented and tested.")
