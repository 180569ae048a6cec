"""What goes in: image files and their checks (images, image_memo), datasets and subsets (dataset, subsets),
training sizes and buckets (sizes), sample prompts (prompts), caption augmentation (augment, augment_config).

May import tasks.store, tasks.config and tasks.lazy; never models or training."""
