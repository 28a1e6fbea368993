import json


def test_config_properties():
    with open("config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["name"] == "sandbox"
    assert type(cfg["workers"]) is int and 2 <= cfg["workers"] <= 8
    ports = cfg["ports"]
    assert len(ports) == 3 and all(type(p) is int and 8000 <= p <= 8099 for p in ports)
    assert ports == sorted(set(ports))
