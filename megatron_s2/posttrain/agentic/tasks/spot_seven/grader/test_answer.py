def test_answer_says_whether_a_seven_is_there():
    with open("input.txt", encoding="utf-8") as f:
        digits = f.read().split()
    assert len(digits) == 4 and all(len(d) == 1 and d.isdigit() for d in digits)
    with open("answer.txt", encoding="utf-8") as f:
        assert f.read().strip() == ("yes" if "7" in digits else "no")
