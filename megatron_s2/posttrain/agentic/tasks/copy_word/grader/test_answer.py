def test_answer_is_the_word():
    with open("word.txt", encoding="utf-8") as f:
        word = f.read().strip()
    with open("answer.txt", encoding="utf-8") as f:
        assert f.read().strip() == word
