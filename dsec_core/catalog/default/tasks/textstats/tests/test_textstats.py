from textstats import average_word_length, char_frequency, top_words, unique_words, word_count


def test_word_count_simple():
    assert word_count("the cat sat on the mat") == 6


def test_word_count_empty():
    assert word_count("   ") == 0


def test_unique_words_ignores_case_and_punctuation():
    assert unique_words("Cat, cat! CAT? dog.") == {"cat", "dog"}


def test_char_frequency_counts_letters_only():
    assert char_frequency("Aa b! 1") == {"a": 2, "b": 1}


def test_top_words_most_common_first():
    assert top_words("b a b c b a", 2) == [("b", 3), ("a", 2)]


def test_top_words_ties_are_alphabetical():
    assert top_words("pear apple fig", 3) == [("apple", 1), ("fig", 1), ("pear", 1)]


def test_average_word_length_ignores_punctuation():
    assert average_word_length("hi, there!") == 3.5


def test_average_word_length_empty():
    assert average_word_length("") == 0.0
