"""The Determined runner: a search-runner experiment on a cluster drives a custom-searcher experiment of trials."""
