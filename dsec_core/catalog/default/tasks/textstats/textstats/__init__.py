"""Small text statistics: word counts, letter frequencies, the most common words."""

import string
from collections import Counter

__all__ = ["words", "word_count", "unique_words", "char_frequency", "top_words",
           "average_word_length"]


def words(text):
    """The words of ``text``, lowercased, with surrounding punctuation removed."""
    out = []
    for raw in text.split():
        word = raw.strip(string.punctuation).lower()
        if word:
            out.append(word)
    return out


def word_count(text):
    return len(words(text))


def unique_words(text):
    return set(words(text))


def char_frequency(text):
    """How often each letter occurs, case-insensitively; other characters are ignored."""
    return dict(Counter(c for c in text.lower() if c.isalpha()))


def top_words(text, n):
    """The ``n`` most common words as (word, count), most common first, ties alphabetical."""
    counts = Counter(words(text))
    # Bug: ties come out in reverse alphabetical order.
    ranked = sorted(counts.items(), key=lambda item: (item[1], item[0]), reverse=True)
    return ranked[:n]


def average_word_length(text):
    """Mean length of the words in ``text`` (punctuation does not count); 0.0 if none."""
    # Bug: splits the raw text, so punctuation counts towards the lengths.
    parts = text.split()
    if not parts:
        return 0.0
    return sum(len(p) for p in parts) / len(parts)
