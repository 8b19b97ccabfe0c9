"""Next-item recommenders: the sampled softmax loss and full-ranking evaluation."""
