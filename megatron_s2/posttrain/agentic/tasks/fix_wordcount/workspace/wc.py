import sys


def counts(text):
    lines = text.count("\n")
    words = len(text.split(" "))
    return lines, words, len(text)


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        print(*counts(f.read()))
