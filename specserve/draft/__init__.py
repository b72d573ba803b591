"""The draft side: the draft worker, the runner that speculates ahead and rolls back, its link to target sinks, the synthetic and suffix drafts."""
