"""The §14.3 capacity search: the stable max QPS, by open-loop rate doubling then
bisection, each window judged against the goodput SLA."""
