"""OutputText (service/output_text.py) reads as the str it replaces: random appends,
slices and cuts against a plain string, and its parts stay few (what keeps appends cheap)."""

from __future__ import annotations

import random

from service.output_text import OutputText


def test_matches_a_plain_string():
    rng = random.Random(0)
    for trial in range(200):
        text, ref = OutputText(), ""
        for _ in range(rng.randint(0, 300)):
            op = rng.random()
            if op < 0.8:
                s = "".join(rng.choice("abc\u00e9\U0001f600") for _ in range(rng.choice([0, 1, 1, 2, 4, 9])))
                text.append(s)
                ref += s
            elif op < 0.9:
                n = rng.randint(0, len(ref))
                text.truncate(n)
                ref = ref[:n]
            else:
                assert str(text) == ref and text == ref and text == OutputText(ref) and text != ref + "x"
            a = rng.randint(0, len(ref))
            b = rng.randint(a, len(ref))
            assert text.slice(a, b) == ref[a:b] and text.slice(a) == ref[a:] and len(text) == len(ref), trial
        assert str(text) == ref


def test_parts_stay_logarithmic():
    text = OutputText()
    for i in range(1 << 15):
        text.append("abcd")
        assert len(text._parts) <= 18, i
    assert len(text) == 4 << 15
