"""Read N, then N lines "a b"; print a + b for each line."""
import sys

lines = sys.stdin.read().split("\n")
n = int(lines[0])
for line in lines[1:n + 1]:
    a, b = map(int, line.split())
    print(a + b)
