"""Ray: start or join a cluster, place generation and training workers, move weights between them."""
