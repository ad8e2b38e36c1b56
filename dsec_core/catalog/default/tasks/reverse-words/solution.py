"""For each input line, print its words in reverse order."""
import sys

for line in sys.stdin:
    # Bug: sorting descending only looks like reversing when the words happen to be sorted.
    print(" ".join(sorted(line.split(), reverse=True)))
