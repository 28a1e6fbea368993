def _is_prime(n):
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def test_first_fifty_primes():
    with open("primes.txt", encoding="utf-8") as f:
        lines = f.read().split()
    numbers = [int(x) for x in lines]
    assert len(numbers) == 50
    assert numbers == sorted(numbers) and all(_is_prime(n) for n in numbers)
    assert numbers[0] == 2 and numbers[-1] == 229
