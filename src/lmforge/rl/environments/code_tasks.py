"""The embedded code task: small Python functions to write, each with hidden unit tests.

Each task is a signature, a one-sentence description, a reference solution and test inputs; the expected
outputs are the reference's, computed in the trainer (trusted code) when the records are built, so no
expected value is ever shown to the sandbox. Every third task is held out (20 of 60): the held-out split
has functions the policy never trained on.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["CODE_TASKS", "code_task_records"]

# (name, signature, description, reference, inputs: each a list of positional arguments)
CODE_TASKS: list[tuple[str, str, str, str, list[list[Any]]]] = [
    ("add", "add(a, b)", "Return the sum of two integers.", "def add(a, b):\n    return a + b",
     [[1, 2], [-5, 5], [100, 23], [0, 0]]),
    ("square", "square(n)", "Return n squared.", "def square(n):\n    return n * n", [[3], [-4], [0], [12]]),
    ("is_even", "is_even(n)", "Return True if n is even, else False.", "def is_even(n):\n    return n % 2 == 0",
     [[2], [7], [0], [-3]]),
    ("maximum", "maximum(xs)", "Return the largest number in a non-empty list.", "def maximum(xs):\n    return max(xs)",
     [[[1, 5, 3]], [[-2, -9]], [[7]], [[4, 4, 1]]]),
    ("reverse_string", "reverse_string(s)", "Return the string reversed.", "def reverse_string(s):\n    return s[::-1]",
     [["abc"], [""], ["racecar"], ["hello world"]]),
    ("count_vowels", "count_vowels(s)", "Return how many vowels (a, e, i, o, u, either case) the string has.",
     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)", [["hello"], ["AEIOU"], ["xyz"], ["Banana"]]),
    ("factorial", "factorial(n)", "Return n! for n >= 0.",
     "def factorial(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r", [[0], [1], [5], [10]]),
    ("fibonacci", "fibonacci(n)", "Return the n-th Fibonacci number, with fibonacci(0) = 0 and fibonacci(1) = 1.",
     "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     [[0], [1], [2], [10], [20]]),
    ("is_palindrome", "is_palindrome(s)", "Return True if the string reads the same backwards.",
     "def is_palindrome(s):\n    return s == s[::-1]", [["level"], ["abc"], [""], ["abba"]]),
    ("sum_list", "sum_list(xs)", "Return the sum of a list of numbers (0 for an empty list).",
     "def sum_list(xs):\n    return sum(xs)", [[[1, 2, 3]], [[]], [[-1, 1]], [[10]]]),
    ("count_words", "count_words(s)", "Return the number of whitespace-separated words in the string.",
     "def count_words(s):\n    return len(s.split())", [["hello world"], [""], ["  a  b c "], ["one"]]),
    ("celsius_to_fahrenheit", "celsius_to_fahrenheit(c)", "Convert Celsius to Fahrenheit (c * 9 / 5 + 32).",
     "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32", [[0], [100], [-40], [37]]),
    ("first_char", "first_char(s)", "Return the first character of the string, or an empty string if it is empty.",
     "def first_char(s):\n    return s[:1]", [["abc"], [""], ["z"]]),
    ("absolute", "absolute(n)", "Return the absolute value of n without using abs().",
     "def absolute(n):\n    return -n if n < 0 else n", [[-3], [4], [0]]),
    ("min_of_three", "min_of_three(a, b, c)", "Return the smallest of three numbers.",
     "def min_of_three(a, b, c):\n    return min(a, b, c)", [[1, 2, 3], [3, 1, 2], [5, 5, 4], [-1, 0, -2]]),
    ("count_char", "count_char(s, c)", "Return how many times character c occurs in s.",
     "def count_char(s, c):\n    return s.count(c)", [["banana", "a"], ["hello", "z"], ["", "a"], ["aaa", "a"]]),
    ("evens", "evens(xs)", "Return the even numbers of the list, in order.",
     "def evens(xs):\n    return [x for x in xs if x % 2 == 0]", [[[1, 2, 3, 4]], [[]], [[1, 3]], [[0, -2, 5]]]),
    ("double_all", "double_all(xs)", "Return a list with every element of xs doubled.",
     "def double_all(xs):\n    return [2 * x for x in xs]", [[[1, 2, 3]], [[]], [[-1, 0]]]),
    ("capitalize_words", "capitalize_words(s)", "Return the string with the first letter of every word upper-cased "
     "and the rest lower-cased (words separated by single spaces).",
     "def capitalize_words(s):\n    return ' '.join(w.capitalize() for w in s.split(' '))",
     [["hello world"], ["PYTHON is fun"], ["a"]]),
    ("gcd", "gcd(a, b)", "Return the greatest common divisor of two positive integers.",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a", [[12, 18], [7, 13], [100, 10], [9, 9]]),
    ("is_prime", "is_prime(n)", "Return True if n is a prime number.",
     "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
     "            return False\n        i += 1\n    return True", [[1], [2], [15], [17], [97], [100]]),
    ("digit_sum", "digit_sum(n)", "Return the sum of the decimal digits of a non-negative integer.",
     "def digit_sum(n):\n    return sum(int(d) for d in str(n))", [[0], [123], [9999], [505]]),
    ("unique", "unique(xs)", "Return the list without duplicates, keeping the first occurrence of each element.",
     "def unique(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n"
     "            out.append(x)\n    return out", [[[1, 2, 1, 3, 2]], [[]], [[5, 5, 5]], [["a", "b", "a"]]]),
    ("second_largest", "second_largest(xs)", "Return the second largest distinct value of a list with at least "
     "two distinct values.", "def second_largest(xs):\n    return sorted(set(xs))[-2]",
     [[[1, 2, 3]], [[5, 5, 4]], [[-1, -2]], [[10, 20, 20, 30]]]),
    ("flatten", "flatten(xss)", "Flatten a list of lists by one level.",
     "def flatten(xss):\n    return [x for xs in xss for x in xs]", [[[[1, 2], [3]]], [[]], [[[], [4]]]]),
    ("count_positive", "count_positive(xs)", "Return how many numbers in the list are greater than zero.",
     "def count_positive(xs):\n    return sum(1 for x in xs if x > 0)", [[[1, -1, 2]], [[]], [[0, 0]], [[-5]]]),
    ("average", "average(xs)", "Return the mean of a non-empty list of numbers.",
     "def average(xs):\n    return sum(xs) / len(xs)", [[[1, 2, 3]], [[4]], [[1, 2]], [[-1, 1]]]),
    ("remove_spaces", "remove_spaces(s)", "Return the string with every space removed.",
     "def remove_spaces(s):\n    return s.replace(' ', '')", [["a b c"], [""], ["  x "]]),
    ("is_sorted", "is_sorted(xs)", "Return True if the list is sorted in non-decreasing order.",
     "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))", [[[1, 2, 2, 3]], [[3, 1]], [[]], [[5]]]),
    ("power_of_two", "power_of_two(n)", "Return True if n is a positive power of two (1, 2, 4, ...).",
     "def power_of_two(n):\n    return n > 0 and n & (n - 1) == 0", [[1], [8], [6], [0], [1024]]),
    ("char_frequency", "char_frequency(s)", "Return a dict mapping each character of s to how many times it occurs.",
     "def char_frequency(s):\n    d = {}\n    for c in s:\n        d[c] = d.get(c, 0) + 1\n    return d",
     [["aab"], [""], ["abc"]]),
    ("merge_sorted", "merge_sorted(a, b)", "Merge two sorted lists into one sorted list.",
     "def merge_sorted(a, b):\n    return sorted(a + b)", [[[1, 3], [2, 4]], [[], [1]], [[1, 1], [1]]]),
    ("rotate_left", "rotate_left(xs, k)", "Rotate the list left by k positions (k may exceed the length; "
     "an empty list stays empty).", "def rotate_left(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n"
     "    return xs[k:] + xs[:k]", [[[1, 2, 3, 4], 1], [[1, 2, 3], 5], [[], 3], [[1], 0]]),
    ("binary_string", "binary_string(n)", "Return the binary representation of a non-negative integer, "
     "without a prefix.", "def binary_string(n):\n    return bin(n)[2:]", [[0], [5], [255], [1]]),
    ("count_upper", "count_upper(s)", "Return how many upper-case letters the string has.",
     "def count_upper(s):\n    return sum(c.isupper() for c in s)", [["Hello World"], ["abc"], ["ABC"]]),
    ("run_length", "run_length(s)", "Run-length encode the string: 'aaabcc' becomes 'a3b1c2'.",
     "def run_length(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n"
     "            j += 1\n        out.append(f'{s[i]}{j - i}')\n        i = j\n    return ''.join(out)",
     [["aaabcc"], [""], ["abc"], ["zzzz"]]),
    ("sum_of_squares", "sum_of_squares(n)", "Return 1^2 + 2^2 + ... + n^2.",
     "def sum_of_squares(n):\n    return sum(i * i for i in range(1, n + 1))", [[0], [1], [3], [10]]),
    ("longest_word", "longest_word(s)", "Return the longest word of the sentence (the first one on ties).",
     "def longest_word(s):\n    return max(s.split(), key=len)", [["the quick brown fox"], ["a bb cc"], ["one"]]),
    ("intersection", "intersection(a, b)", "Return the sorted list of values present in both lists, without "
     "duplicates.", "def intersection(a, b):\n    return sorted(set(a) & set(b))",
     [[[1, 2, 3], [2, 3, 4]], [[], [1]], [[1, 1, 2], [1]]]),
    ("chunk", "chunk(xs, n)", "Split the list into consecutive chunks of length n (the last may be shorter).",
     "def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]",
     [[[1, 2, 3, 4, 5], 2], [[], 3], [[1, 2], 5]]),
    ("swap_case", "swap_case(s)", "Return the string with upper-case letters lower-cased and vice versa.",
     "def swap_case(s):\n    return s.swapcase()", [["Hello"], [""], ["aBc1"]]),
    ("triangle_number", "triangle_number(n)", "Return 1 + 2 + ... + n.",
     "def triangle_number(n):\n    return n * (n + 1) // 2", [[0], [1], [4], [100]]),
    ("clamp", "clamp(x, lo, hi)", "Return x limited to the range [lo, hi].",
     "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))", [[5, 0, 10], [-3, 0, 10], [12, 0, 10], [0, 0, 0]]),
    ("is_anagram", "is_anagram(a, b)", "Return True if the two strings are anagrams of each other.",
     "def is_anagram(a, b):\n    return sorted(a) == sorted(b)", [["listen", "silent"], ["abc", "abd"], ["", ""]]),
    ("last_n", "last_n(xs, n)", "Return the last n elements of the list (all of it if n exceeds its length; "
     "none for n = 0).", "def last_n(xs, n):\n    return xs[len(xs) - n:] if n < len(xs) else list(xs)",
     [[[1, 2, 3], 2], [[1], 5], [[1, 2], 0]]),
    ("product", "product(xs)", "Return the product of the numbers in the list (1 for an empty list).",
     "def product(xs):\n    r = 1\n    for x in xs:\n        r *= x\n    return r", [[[1, 2, 3, 4]], [[]], [[5, -1]]]),
    ("count_digits", "count_digits(s)", "Return how many characters of the string are decimal digits.",
     "def count_digits(s):\n    return sum(c.isdigit() for c in s)", [["a1b2c3"], [""], ["123"]]),
    ("index_of", "index_of(xs, x)", "Return the index of the first occurrence of x in xs, or -1 if absent.",
     "def index_of(xs, x):\n    return xs.index(x) if x in xs else -1", [[[1, 2, 3], 2], [[1], 5], [[4, 4], 4]]),
    ("acronym", "acronym(s)", "Return the upper-cased first letters of the words of s.",
     "def acronym(s):\n    return ''.join(w[0].upper() for w in s.split())",
     [["portable network graphics"], ["as soon as possible"], ["x"]]),
    ("cumulative_sum", "cumulative_sum(xs)", "Return the running totals of the list.",
     "def cumulative_sum(xs):\n    out, t = [], 0\n    for x in xs:\n        t += x\n        out.append(t)\n    return out",
     [[[1, 2, 3]], [[]], [[5, -5, 5]]]),
    ("vowel_positions", "vowel_positions(s)", "Return the indices of the lower-case vowels (aeiou) in s.",
     "def vowel_positions(s):\n    return [i for i, c in enumerate(s) if c in 'aeiou']", [["hello"], ["xyz"], ["aeb"]]),
    ("pairs_summing_to", "pairs_summing_to(xs, t)", "Return how many index pairs i < j have xs[i] + xs[j] == t.",
     "def pairs_summing_to(xs, t):\n    return sum(1 for i in range(len(xs)) for j in range(i + 1, len(xs)) "
     "if xs[i] + xs[j] == t)", [[[1, 2, 3, 4], 5], [[], 1], [[2, 2, 2], 4]]),
    ("reverse_words", "reverse_words(s)", "Return the words of the sentence in reverse order, joined by single spaces.",
     "def reverse_words(s):\n    return ' '.join(reversed(s.split()))", [["one two three"], ["a"], [""]]),
    ("nth_prime", "nth_prime(n)", "Return the n-th prime number (nth_prime(1) = 2).",
     "def nth_prime(n):\n    c, k = 0, 1\n    while c < n:\n        k += 1\n        if all(k % d for d in range(2, int(k ** 0.5) + 1)):\n"
     "            c += 1\n    return k", [[1], [2], [5], [10]]),
    ("title_length", "title_length(s)", "Return the number of characters of s, not counting spaces.",
     "def title_length(s):\n    return len(s) - s.count(' ')", [["a b c"], [""], ["abc"]]),
    ("max_gap", "max_gap(xs)", "Return the largest difference between consecutive elements of the sorted list "
     "(0 for fewer than two elements).", "def max_gap(xs):\n    ys = sorted(xs)\n"
     "    return max((b - a for a, b in zip(ys, ys[1:])), default=0)", [[[1, 10, 3]], [[5]], [[4, 4]], [[]]]),
    ("is_leap_year", "is_leap_year(y)", "Return True if the year is a Gregorian leap year.",
     "def is_leap_year(y):\n    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)", [[2000], [1900], [2024], [2023]]),
    ("caesar", "caesar(s, k)", "Shift every lower-case letter of s by k places in the alphabet (wrapping); "
     "leave other characters unchanged.", "def caesar(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) "
     "if 'a' <= c <= 'z' else c for c in s)", [["abc", 1], ["xyz", 3], ["a b!", 25]]),
    ("dedupe_adjacent", "dedupe_adjacent(xs)", "Remove consecutive duplicates: [1, 1, 2, 1] becomes [1, 2, 1].",
     "def dedupe_adjacent(xs):\n    return [x for i, x in enumerate(xs) if i == 0 or xs[i - 1] != x]",
     [[[1, 1, 2, 1]], [[]], [[3, 3, 3]]]),
    ("matrix_transpose", "matrix_transpose(m)", "Return the transpose of a rectangular matrix given as a list of rows.",
     "def matrix_transpose(m):\n    return [list(r) for r in zip(*m)]", [[[[1, 2], [3, 4]]], [[[1, 2, 3]]], [[]]]),
]


def _expected(name: str, reference: str, inputs: list[list[Any]]) -> list[Any]:
    scope: dict[str, Any] = {}
    exec(reference, scope)  # noqa: S102 - the repository's own reference solutions, not model output
    return [json.loads(json.dumps(scope[name](*args))) for args in inputs]


def code_task_records(split: str) -> list[dict[str, Any]]:
    """Prompt records of ``split`` (``train``: 40, ``test``: 20): ``prompt``, ``task`` ("code"),
    ``entry_point`` and ``tests`` (JSON: inputs and expected outputs), which the reward reads."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be train or test, got {split!r}")
    out = []
    for k, (name, signature, description, reference, inputs) in enumerate(CODE_TASKS):
        if (k % 3 == 2) != (split == "test"):
            continue
        tests = [{"args": args, "expected": want} for args, want in zip(inputs, _expected(name, reference, inputs))]
        prompt = (f"Write a Python function `{signature}`. {description}\n"
                  "Give the complete function in a ```python code block.")
        out.append({"prompt": prompt, "task": "code", "entry_point": name, "tests": json.dumps(tests)})
    return out
