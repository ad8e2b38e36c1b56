"""For each input line, print YES if its brackets ()[]{} are balanced, else NO."""
import sys

for line in sys.stdin:
    line = line.strip()
    # Bug: counting opens and closes ignores their order and their kinds.
    opens = sum(line.count(c) for c in "([{")
    closes = sum(line.count(c) for c in ")]}")
    print("YES" if opens == closes else "NO")
