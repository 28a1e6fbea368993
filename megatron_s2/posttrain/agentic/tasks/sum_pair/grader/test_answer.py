def test_answer_is_the_sum():
    with open("input.txt", encoding="utf-8") as f:
        a, b = (int(x) for x in f.read().split())
    with open("answer.txt", encoding="utf-8") as f:
        assert f.read().strip() == str(a + b)
